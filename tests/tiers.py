"""Every test file's tier, in one table: what a test costs decides when it runs.

    fast       (no marker)  CPU-only checks of a few seconds at most: `python -m pytest` runs
                            these (the README's test line; about a minute on 2 cores)
    processes               starts processes: ranks, the CLI in a subprocess, benchmark scripts
    e2e                     trains a model end to end (the CLI's train, the Python API, runs
                            resumed and exported)
    fuzz                    thorough randomized and hostile-input sweeps
    thorough                exactness sweeps that train (every cache policy against the resident
                            model, packed training against the reference) and the largest planning
                            and kernel cases (wide_1000 for 64 ranks, long chunks): seconds each
    slow, gpu               marked in the files themselves, as before: minutes; CUDA

`.ci/run` runs the fast tier, then the other CPU tiers (`-m "(processes or e2e or fuzz or
thorough) and not gpu and not slow"`), so every CPU test runs in CI once. A file
missing from `FILES` fails collection with a message that names this table, so a new file
cannot land in a tier silently; `TESTS` moves single tests of a file to another tier.
"""
from __future__ import annotations

TIERS = ("processes", "e2e", "fuzz", "thorough")
FAST: frozenset[str] = frozenset()

FILES: dict[str, frozenset[str]] = {
    # unit: planning, operators, caches, data staging: fast unless noted
    **{f"tests/unit/{name}.py": FAST for name in (
        "test_bench_costmodel_merge", "test_doctor_versions", "test_transfer_stage", "test_bench_host_noise", "test_bench_calibration_noise", "test_bench_later_epochs", "test_bench_hit_rate", "test_bench_lookahead_fetches", "test_bench_dense_bound", "test_bench_weight_grads", "test_bench_first_layer", "test_tool_help_strings", "test_bench_dropout", "test_bench_row_hashes", "test_cache_model",
        "test_cache_next_use",
        "test_cache_scratchpad", "test_checkpoint_rank_deltas", "test_checkpoint_shards", "test_rank_reports", "test_sharded_init",
        "test_cost_calibrated", "test_cost_exchange", "test_data_batches", "test_data_rowcache", "test_data_rowpack", "test_data_cachesim", "test_data_checks",
        "test_data_dask", "test_data_lookahead_synth", "test_data_profile_hot", "test_access_unseen", "test_access_epoch", "test_data_strata",
        "test_evalmetrics", "test_fake_cuda_runtime", "test_transfer_pricing", "test_fake_cuda_static", "test_gpu_report",
        "test_gpu_lease",
        "test_graph_build", "test_graph_verify", "test_incremental_rows", "test_kernels_nvrtc", "test_cupy_stream_choice", "test_data_priority",
        "test_layers", "test_operators_backends", "test_operators_casting", "test_operators_casting_cpu", "test_operators_dense",
        "test_operators_embedding", "test_restored_tables", "test_package_digests", "test_cli_help_layout", "test_restart_lines", "test_operators_fused_update", "test_passes_literal",
        "test_plan_contract", "test_planner_cache", "test_planner_cost", "test_planner_interleave",
        "test_planner_manager", "test_planner_pack", "test_planner_shard", "test_pt2_save",
        "test_render", "test_movielens_releases", "test_runtime_hostmem", "test_runtime_session", "test_spec_limits",
        "test_spec_roundtrip", "test_spec_training", "test_spec_validate", "test_spec_yaml_scan", "test_spec_many_names",
        "test_table_snapshot", "test_checkpoint_stream", "test_checkpoint_direct", "test_cores", "test_train_loop_parts", "test_vocab_growth", "test_split_fit", "test_output_guard",
        "test_custom", "test_custom_hostile", "test_custom_guards", "test_heads", "test_mlp_regularize", "test_moe", "test_packed_mlp_lowering", "test_table_l2",
        "test_managed_spec", "test_managed_map", "test_managed_shards", "test_days", "test_self_attention", "test_similarity",
        "test_retrieval", "test_calibrate_collective", "test_targets", "test_compiled_fallback",
        "test_dense_optimizer_fused", "test_source_mlp", "test_next_item_data", "test_truncate", "test_memory_fit",
        "test_robust_timing", "test_cost_kinds", "test_onednn_linear", "test_gemm_library", "test_cost_shared_cores", "test_cost_call_fit", "test_cost_managed",
        "test_cost_epoch_start", "test_kept_sample", "test_encoder_of_best", "test_encode_together", "test_line_column", "test_data_doctests",
        "test_planner_doctests", "test_empty_columns_pass", "test_pt2_module", "test_serving_tables", "test_serving_lookups",
        "test_doc_links",
    )},
    "tests/unit/test_pack_scale.py": FAST,  # pack at scale: the one-pass rewrite gives the old plan, linear slots
    "tests/unit/test_profile_plausible.py": FAST,  # implausible device profiles and non-targets refused
    "tests/unit/test_lifecycle_hostile.py": FAST,  # hostile input to runs, --follow, plan --managed-from
    "tests/unit/test_model_language_hostile.py": FAST,  # hostile specs of custom, heads, retrieval, sequences
    "tests/unit/test_labels7_messages.py": FAST,  # text labels, counts of one, close column names, NaN scores
    "tests/unit/test_walk_hostile.py": FAST,  # what a hostile user walking the README found
    "tests/unit/test_cli_errors.py": FAST,  # the command line's own errors: one line, exit 2, every command
    "tests/unit/test_ingest_hostile.py": FAST,  # the seeded split, Parquet folders, missing spec files
    "tests/unit/test_walk4_hostile.py": FAST,  # export / predict of the newer model kinds, as a hostile user
    "tests/unit/test_readme_walk.py": FAST,  # what a new user following README.md and its pages found
    "tests/unit/test_walk7.py": FAST,  # a seventh walk of README.md and docs/guide.md as a new user
    "tests/unit/test_runs8.py": FAST,  # resuming a finished run, eval and export of a run: round 8
    "tests/unit/test_runs9.py": FAST,  # a finished run's full load on request, its --nproc resume; damaged runs
    "tests/unit/test_api_nproc_refusals.py": FAST,  # flowrec.train(nproc=N): refused before any rank starts
    "tests/unit/test_api_resume.py": FAST,  # flowrec.train(spec, resume=RUN): bitwise, finished, refused, CLI <-> Python
    "tests/unit/test_api_hostile.py": FAST,  # the Python API given hostile and careless arguments and callbacks
    "tests/unit/test_run_folder_refusals.py": FAST,  # devices, run folders and their locks, Python-built specs: one line each
    "tests/unit/test_walk8.py": FAST,  # an eighth walk: the Python API and the model language, as a demanding user
    "tests/unit/test_precision_note.py": FAST,  # bf16 where the CPU has no bf16 kernels: warned, doctor says so
    "tests/unit/test_lowp.py": FAST,  # bf16 products as fp32 products of bf16 values where the CPU has no bf16 kernels
    "tests/unit/test_walk3_hostile.py": FAST,  # a third walk: sequence separators, Arrow at exit, the model language
    "tests/unit/test_managed_hostile.py": FAST,  # edited or damaged managed map states, negatives seeds
    "tests/unit/test_stop_requested.py": FAST,  # a first stop signal to a run is one line at once
    "tests/unit/test_annotation_names.py": FAST,  # names in the CLI's annotations bound (TYPE_CHECKING imports)
    "tests/unit/test_id_forms.py": FAST,  # ids of hashed and managed tables in another form than at training
    "tests/unit/test_id_form_samples.py": FAST,  # the id-form check of all features at once, as one at a time
    "tests/unit/test_json_scan_tokens.py": FAST,  # the JSON pre-scan reads its own tokens only, with the same answers
    "tests/unit/test_data_duplicates.py": FAST,  # exact duplicate rows named; the seeded split keeps copies on one side
    "tests/unit/test_split_hashes.py": FAST,  # the seeded split hashes each row once over the fit and write passes
    "tests/unit/test_split_resume.py": frozenset({"e2e"}),  # a run of before rule 3 resumed without its data: same rows
    "tests/unit/test_convert_hostile.py": FAST,  # hostile files given to data convert: bounded memory, one line
    "tests/unit/test_sources_hostile.py": FAST,  # raw readers given hostile forms of real inputs
    "tests/unit/test_sources_scoring.py": FAST,  # predict reads only the package's columns, in every format that can
    "tests/unit/test_serving_hostile.py": frozenset({"e2e"}),
    "tests/unit/test_serving_inputs.py": frozenset({"e2e"}),  # trains and exports a run: a torch-only caller's hostile tensors
    "tests/unit/test_serving_devices.py": frozenset({"thorough"}),  # exports every spec kind (no training): each node on the inputs' device
    "tests/unit/test_predict_frames.py": FAST,  # predict's DataFrame to Arrow, column by column for a few rows
    "tests/unit/test_serving_hostile7.py": frozenset({"e2e"}),  # retrieval items' types, hostile packages and rows
    "tests/unit/test_serving_leftovers.py": frozenset({"e2e"}),  # predict's empty columns, look-alike names, hostile packages
    "tests/unit/test_profile_step.py": frozenset({"e2e"}),
    "tests/unit/test_checkpoint_marks.py": frozenset({"e2e"}),  # trains with and without checkpoints  # trains a few steps under the profiler  # tampered retrieval packages, eval options
    "tests/unit/test_cache_bench.py": frozenset({"processes"}),
    "tests/unit/test_operators_bench.py": frozenset({"processes"}),
    "tests/unit/test_bench_package_load.py": frozenset({"processes"}),  # tools/bench_package_load.py, one round
    "tests/unit/test_bench_resume.py": frozenset({"processes"}),  # tools/bench_resume.py, one round
    "tests/unit/test_fake_cuda_tier.py": frozenset({"processes"}),
    "tests/unit/test_bounded_waits.py": frozenset({"processes"}),  # a hung child killed with its tree, its output shown
    "tests/unit/test_waits_have_deadlines.py": FAST,  # no test child without a deadline that kills its tree (ast scan)
    "tests/unit/test_spec_fuzz.py": frozenset({"fuzz"}),
    **{f"tests/unit/{name}.py": frozenset({"thorough"}) for name in (
        "test_cache_exact", "test_cache_fae", "test_cache_fae_bytes", "test_cache_model", "test_train_reference",
        "test_mlp_regularize_training", "test_managed_training", "test_compiled_dense",
        "test_retrieval_negatives_cached", "test_module_doctests",
    )},
    # integration: the CLI, runs, data conversion, distributed training
    **{f"tests/integration/{name}.py": FAST for name in (
        "test_cli_doctor", "test_cli_plan", "test_cli_spec", "test_cli_spec_hostile", "test_dist_rows",
    )},
    **{f"tests/integration/{name}.py": frozenset({"processes"}) for name in (
        "test_bench_costmodel_smoke", "test_bench_dist_smoke", "test_bench_train_smoke", "test_data_bench", "test_dist_embedding",
        "test_dist_incremental", "test_dist_specs", "test_dist_train", "test_sigkill_resume",
        "test_dist_managed_owner", "test_dist_checkpoint_background", "test_dist_start",
        "test_nproc_signals", "test_data_signals", "test_dist_managed", "test_retrieval_negatives_ranks", "test_retrieval_ranks_exact",
        "test_nproc_nonfinite", "test_nproc_custom_failure", "test_nproc_rank_stops",
        "test_api_nproc",  # flowrec.train(nproc=2): as the command line's ranks, failures, Ctrl-C
        "test_api_nproc_stops",  # flowrec.train(nproc=2) stopped: SIGTERM/SIGHUP, deaf ranks, max_restarts
    )},
    **{f"tests/integration/{name}.py": frozenset({"e2e"}) for name in (
        "test_calibrate", "test_cli_options", "test_data_convert", "test_data_diagnostics",
        "test_encoder_travels", "test_incremental", "test_init_from_tuning", "test_incremental_checkpoints", "test_model_package",
        "test_predict_criteo", "test_python_api", "test_run_guarantees", "test_run_hostile", "test_train",
        "test_train_loop", "test_train_plan", "test_train_compile", "test_vocab_spare", "test_output_hostile", "test_package_hostile",
        "test_custom_module", "test_heads_package", "test_regularize_package", "test_managed_runs", "test_follow",
        "test_tower_package", "test_sequence_package", "test_truncate_package", "test_runs_lifecycle", "test_retrieval_serving",
        "test_sasrec_train", "test_sequence_recommend", "test_eval_group_by",
        "test_moved_run_class_file", "test_skip_hint_command", "test_resumed_state", "test_serving_walk7",
    )},
    **{f"tests/integration/{name}.py": frozenset({"fuzz"}) for name in (
        "test_checkpoint_fuzz", "test_data_fuzz", "test_data_hostile",
    )},
    # gpu: marked `gpu` in the files (skipped without CUDA)
    **{f"tests/gpu/{name}.py": FAST for name in ("test_cache_gpu", "test_device_gpu", "test_operators_gpu", "test_specs_gpu")},
}

# single tests whose cost differs from their file's ("file::test name", parameters left out)
TESTS: dict[str, frozenset[str]] = {
    "tests/integration/test_cli_spec_hostile.py::test_output_to_a_full_disk_is_one_line_not_a_traceback":
        frozenset({"processes"}),
    "tests/unit/test_api_resume.py::test_a_run_of_two_ranks_goes_on_in_python_as_on_the_command_line":
        frozenset({"processes"}),
    "tests/unit/test_serving_hostile.py::test_the_separator_note_reads_a_spec_with_data_options": frozenset(),
    "tests/unit/test_custom_hostile.py::test_a_command_whose_class_file_left_a_thread_running_ends": frozenset({"processes"}),
    "tests/unit/test_custom_guards.py::test_os_exit_in_a_class_file_ends_flowrec_with_a_failure_and_one_line":
        frozenset({"processes"}),
    "tests/unit/test_custom_guards.py::test_a_ranks_share_of_one_row_skips_that_step_on_every_rank":
        frozenset({"processes"}),
    "tests/unit/test_serving_leftovers.py::test_a_specs_table_map_is_made_once_and_a_spec_still_pickles": frozenset(),
    "tests/unit/test_bench_later_epochs.py::test_a_real_run_times_every_epoch_of_both_runs": frozenset({"processes"}),
    "tests/unit/test_bench_calibration_noise.py::test_a_real_run_measures_both_settings_with_their_own_rounds_and_blocks":
        frozenset({"processes"}),
    "tests/unit/test_cores.py::test_a_users_omp_threads_survive_the_first_sparse_update": frozenset({"processes"}),
    "tests/unit/test_pt2_save.py::test_a_write_that_fails_is_an_exception_not_an_abort_at_exit": frozenset({"processes"}),
    "tests/unit/test_kept_sample.py::test_a_run_reads_its_data_once_to_sample_and_trains_as_before": frozenset({"e2e"}),
    "tests/unit/test_sources_hostile.py::test_predict_refuses_a_libsvm_row_giving_a_one_hot_feature_two_indices":
        frozenset({"e2e"}),
    "tests/unit/test_id_forms.py::test_ids_written_as_floats_after_training_on_integers_are_said": frozenset({"e2e"}),
    "tests/unit/test_id_forms.py::test_a_day_of_a_stream_that_writes_its_ids_as_floats_is_said": frozenset({"e2e"}),
    "tests/unit/test_id_forms.py::test_evaluation_data_that_writes_its_ids_as_floats_is_said": frozenset({"e2e"}),
    "tests/unit/test_id_forms.py::test_eval_reads_the_encoder_record_of_its_data_once": frozenset({"e2e"}),
    "tests/unit/test_id_forms.py::test_export_says_when_the_rows_of_its_score_check_write_ids_otherwise":
        frozenset({"e2e"}),
    "tests/unit/test_id_forms.py::test_ids_beyond_int64_that_pandas_read_as_python_ints_are_one_line_naming_the_column":
        frozenset({"e2e"}),
    "tests/unit/test_id_forms.py::test_zero_padded_ids_read_by_pandas_as_numbers_are_said": frozenset({"e2e"}),
    "tests/unit/test_annotation_names.py::test_the_trainer_annotation_imports_nothing_at_start": frozenset({"processes"}),
    "tests/unit/test_ingest_hostile.py::test_a_feature_column_empty_in_a_parquet_file_and_in_bound_training_data_is_said":
        frozenset({"e2e"}),
    "tests/unit/test_kept_sample.py::test_the_startup_benchmark_reads_each_file_once_kept_and_twice_not": frozenset({"e2e"}),
    "tests/unit/test_calibrate_collective.py::test_two_gloo_processes_give_a_usable_fit": frozenset({"processes"}),
    "tests/unit/test_calibrate_collective.py::test_processes_that_do_not_finish_in_time_are_killed_and_named":
        frozenset({"processes"}),
    "tests/unit/test_cost_shared_cores.py::test_two_processes_step_the_spec_at_once": frozenset({"processes"}),
    "tests/unit/test_run_folder_refusals.py::test_a_run_folder_locked_by_another_process_still_names_it_another_run":
        frozenset({"processes"}),
    "tests/unit/test_cost_call_fit.py::test_two_processes_step_two_layouts_and_fit_them": frozenset({"processes"}),
    "tests/unit/test_render.py::test_svg_is_deterministic_across_processes": frozenset({"processes"}),
    "tests/unit/test_runs8.py::test_eval_and_resume_of_a_model_without_dropout_never_import_dynamo":
        frozenset({"processes"}),
    "tests/unit/test_runs9.py::test_a_run_trained_on_two_ranks_resumed_on_two_is_said_finished_from_its_shards":
        frozenset({"processes"}),
    "tests/integration/test_cli_plan.py::test_planning_imports_no_torch_or_dask": frozenset({"processes"}),
    "tests/integration/test_cli_spec_hostile.py::test_loader_crashers_in_subprocess": frozenset({"processes"}),
    "tests/integration/test_cli_spec_hostile.py::test_fifo_as_spec_does_not_block": frozenset({"processes"}),
    "tests/integration/test_cli_doctor.py::test_doctor_on_this_machine": frozenset({"processes"}),
    "tests/integration/test_cli_doctor.py::test_a_collective_that_cannot_start_fails": frozenset({"processes"}),
    "tests/integration/test_run_hostile.py::test_out_on_a_read_only_folder_is_one_line_before_training_and_leaves_nothing":
        frozenset({"processes"}),
    "tests/unit/test_spec_yaml_scan.py::test_scan_never_counts_more_than_the_document_has": frozenset({"fuzz"}),
    "tests/unit/test_managed_hostile.py::test_a_checkpoint_with_an_edited_map_is_refused_by_resume_eval_and_export":
        frozenset({"e2e"}),
    "tests/unit/test_retrieval.py::test_sampled_negatives_are_drawn_only_from_rows_that_hold_an_item":
        frozenset({"e2e"}),
    **{f"tests/unit/{test}": frozenset({"thorough"}) for test in (
        "test_planner_shard.py::test_wide_1000_on_64_h100s_has_bytes_per_rank_for_every_group",
        "test_planner_shard.py::test_more_ranks_less_memory_and_link_changes_across_nodes",
        "test_plan_contract.py::test_plan_round_trips_through_json",
        "test_plan_contract.py::test_cpu_without_budget_keeps_every_table_resident",
        "test_operators_fused_update.py::test_long_chunks_on_a_strided_table_equal_the_reference",
        "test_planner_manager.py::test_every_spec_plans_validates_and_is_deterministic",
        "test_moe.py::test_packed_experts_train_as_unpacked_experts",
        "test_moe.py::test_one_expert_with_its_constant_gate_is_the_shared_bottom_model",
        "test_custom.py::test_training_equals_the_user_module_in_plain_pytorch",
        "test_heads.py::test_training_equals_reference_with_the_hand_written_loss",
        "test_retrieval.py::test_training_equals_the_reference",
        "test_cache_scratchpad.py::test_planner_bytes_per_step_match_counters",
        "test_managed_map.py::test_entries_merge_equals_a_sort_of_both",
        "test_similarity.py::test_two_tower_trains_like_plain_pytorch",
        "test_cost_calibrated.py::test_dense_step_seconds_times_real_dense_steps",
        "test_cost_calibrated.py::test_dense_step_seconds_gives_a_retrieval_loss_what_train_step_does",
        "test_cost_calibrated.py::test_live_step_seconds_times_steps_fed_by_the_pipeline",
        "test_cost_calibrated.py::test_live_and_staged_steps_alternate_in_blocks",
        "test_cost_epoch_start.py::test_epoch_seconds_times_the_trainers_epochs_beside_one_long_epoch",
        "test_table_l2.py::test_training_with_table_l2_equals_the_loss_term_reference",
    )},
}


def tiers_of(path: str, test: str) -> frozenset[str] | None:
    """The tier markers of test `test` (its function name) in file `path` (relative to the repo,
    with `/`); None when the file is in no tier."""
    override = TESTS.get(f"{path}::{test}")
    if override is not None:
        return override
    return FILES.get(path)
