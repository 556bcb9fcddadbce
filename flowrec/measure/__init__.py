"""Measuring this machine and this model: `flowrec calibrate` (`calibrate`, `ops`, `step`,
`collective`), `flowrec doctor` (`doctor`) and the unpacked plain-PyTorch reference model
(`reference`) that exactness tests and benchmarks compare against."""
