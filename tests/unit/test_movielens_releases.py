"""`--format movielens` reads every GroupLens release by its files: 100K (u.*), 1M (``::`` .dat with
users), 10M (``::`` .dat without users) and 20M+ (ratings.csv, movies.csv): the same columns, the
ratings file's order, missing user columns where a release has no users, and one line naming the
files of every release for a folder of none."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from flowrec.data.convert import convert
from flowrec.data.error_log import ErrorLog
from flowrec.data.layout import DataError
from flowrec.data.sources import movielens_release, read_movielens
from flowrec.spec import load_spec

COLUMNS = ["user_id", "item_id", "rating", "timestamp", "age", "gender", "occupation", "zip_code", "genres",
           "release_year", "label", "rating_5", "__line__"]


def _read(folder: Path):
    tables = list(read_movielens(folder, {}, ErrorLog("fail", str(folder)), set()))
    assert len(tables) == 1
    return tables[0]


def _random_release(rng: np.random.Generator, rows: int = 500):
    users = pd.DataFrame({"user": np.arange(1, 41), "gender": rng.choice(["F", "M"], 40),
                          "age": rng.choice([1, 18, 25, 35, 45, 50, 56], 40), "occupation": rng.integers(0, 21, 40),
                          "zip": [f"{z:05d}" for z in rng.integers(0, 99999, 40)]})
    titles = [f"Film {i}: The {'Return' if i % 2 else 'Start'} ({1930 + i % 80})" for i in range(1, 61)]
    titles[5] = "Untitled"  # no year
    genres = ["|".join(sorted(rng.choice(["Comedy", "Drama", "Sci-Fi", "Children's"], rng.integers(1, 3),
                                         replace=False))) for _ in range(60)]
    movies = pd.DataFrame({"movie": np.arange(1, 61), "title": titles, "genres": genres})
    ratings = pd.DataFrame({"user": rng.zipf(1.6, rows) % 40 + 1, "movie": rng.zipf(1.3, rows) % 60 + 1,
                            "rating": rng.integers(1, 6, rows), "ts": rng.integers(9e8, 1e9, rows)})
    return users, movies, ratings


def _write_dat(folder: Path, users, movies, ratings, with_users: bool) -> None:
    folder.mkdir()
    (folder / "ratings.dat").write_text("".join(f"{u}::{m}::{r}::{t}\n" for u, m, r, t in ratings.itertuples(index=False)))
    (folder / "movies.dat").write_text("".join(f"{m}::{t}::{g}\n" for m, t, g in movies.itertuples(index=False)),
                                       encoding="latin-1")
    if with_users:
        (folder / "users.dat").write_text("".join(f"{u}::{g}::{a}::{o}::{z}\n"
                                                  for u, g, a, o, z in users.itertuples(index=False)))


def _expected(users, movies, ratings, with_users: bool) -> pd.DataFrame:
    df = ratings.merge(movies, on="movie", how="left")
    if with_users:
        df = df.merge(users, on="user", how="left")
    return df


@pytest.mark.parametrize("release", ["1M", "10M", "20M+"])
def test_each_release_reads_into_the_same_columns_in_the_ratings_order(tmp_path: Path, release: str):
    rng = np.random.default_rng(abs(hash(release)) % 2**32)
    users, movies, ratings = _random_release(rng)
    folder = tmp_path / release
    if release == "20M+":
        ratings = ratings.assign(rating=ratings["rating"] - 0.5 * rng.integers(0, 2, len(ratings)))
        folder.mkdir()
        ratings.rename(columns={"user": "userId", "movie": "movieId", "ts": "timestamp"}).to_csv(
            folder / "ratings.csv", index=False)
        genres = movies["genres"].tolist()
        genres[1] = "(no genres listed)"  # movie 2: the most rated (ids from a Zipf draw)
        movies = movies.assign(genres=genres)
        movies.rename(columns={"movie": "movieId"}).to_csv(folder / "movies.csv", index=False)
    else:
        _write_dat(folder, users, movies, ratings, with_users=release == "1M")
    assert movielens_release(folder) == release
    got = _read(folder)
    assert got.column_names == COLUMNS and got.num_rows == len(ratings)
    want = _expected(users, movies, ratings, release == "1M")
    assert got["user_id"].to_pylist() == want["user"].tolist()
    assert got["item_id"].to_pylist() == want["movie"].tolist()
    assert got["rating"].to_pylist() == want["rating"].astype(float).tolist()
    assert got["timestamp"].to_pylist() == want["ts"].tolist()
    assert got["label"].to_pylist() == (want["rating"] >= 4).astype(float).tolist()
    assert got["rating_5"].to_pylist() == (want["rating"] == 5).astype(float).tolist()
    assert got["__line__"].to_pylist() == list(range(1, len(ratings) + 1))
    years = got["release_year"].to_pylist()
    for title, year in zip(want["title"], years):
        assert year == (None if title == "Untitled" else int(title[-5:-1]))
    genres = got["genres"].to_pylist()
    assert release != "20M+" or [] in genres
    for text, names in zip(want["genres"], genres):
        assert names == ([] if text == "(no genres listed)" else text.split("|"))
    if release == "1M":
        assert got["gender"].to_pylist() == want["gender"].tolist()
        assert got["age"].to_pylist() == want["age"].tolist()
        assert got["occupation"].to_pylist() == want["occupation"].tolist()
        assert got["zip_code"].to_pylist() == want["zip"].tolist()
    else:
        for c in ("age", "gender", "occupation", "zip_code"):
            assert got[c].null_count == len(ratings), c
        assert str(got["gender"].type) in ("string", "large_string")


def test_the_1m_layout_of_the_100k_data_reads_as_the_100k_folder(shared_data: Path, tmp_path: Path):
    """The 100K ratings, users and movies written in the 1M layout: every shared column equal."""
    src = shared_data / "movielens-100k"
    if not (src / "u.data").is_file():
        pytest.skip("MovieLens-100k not in ../shared/data")
    base = _read(src)
    ratings = pd.read_csv(src / "u.data", sep="\t", header=None)
    users = pd.read_csv(src / "u.user", sep="|", header=None, dtype={4: str})
    items = pd.read_csv(src / "u.item", sep="|", header=None, encoding="latin-1")
    names = [line.split("|")[0] for line in (src / "u.genre").read_text("latin-1").splitlines() if line]
    flags = items.iloc[:, -19:].to_numpy(bool)
    years = pd.to_datetime(items[2], format="%d-%b-%Y", errors="coerce").dt.year
    folder = tmp_path / "ml"
    folder.mkdir()
    (folder / "ratings.dat").write_text("".join(f"{a}::{b}::{c}::{d}\n" for a, b, c, d in ratings.itertuples(index=False)))
    (folder / "users.dat").write_text("".join(f"{u}::{g}::{a}::{o}::{z}\n" for u, a, g, o, z in users.itertuples(index=False)))
    titles = [f"Film: {i} ({int(y)})" if y == y else "Unknown" for i, y in zip(items[0], years)]
    (folder / "movies.dat").write_text("".join(f"{i}::{t}::{'|'.join(n for n, on in zip(names, row) if on)}\n"
                                               for i, t, row in zip(items[0], titles, flags)), encoding="latin-1")
    got = _read(folder)
    for column in ("user_id", "item_id", "rating", "timestamp", "age", "gender", "zip_code", "genres", "release_year",
                   "label", "rating_5", "__line__"):
        assert got[column].to_pylist() == base[column].to_pylist(), column


def test_a_folder_of_no_release_and_a_bad_ratings_line_are_one_line(tmp_path: Path):
    (tmp_path / "ratings.dat").write_text("1::2::5::978300760\n")
    with pytest.raises(DataError, match=r"not a MovieLens folder: .*1M: ratings.dat, users.dat, movies.dat"):
        movielens_release(tmp_path)
    (tmp_path / "movies.dat").write_text("2::Film (1999)::Drama\n")
    (tmp_path / "ratings.dat").write_text("1::2::5::978300760\n1::x::4::978300761\n")
    with pytest.raises(DataError, match=r"ratings.dat:2: not user::item::rating::timestamp"):
        _read(tmp_path)
    (tmp_path / "ratings.dat").write_text("1::2::5::978300760\n")
    (tmp_path / "movies.dat").write_text("2::Film (1999)\n")
    with pytest.raises(DataError, match=r"movies.dat:1: 2 '::'-separated fields, expected 3"):
        _read(tmp_path)


def _100k(tmp_path: Path, data: str, item: str = "2|Film (1995)|01-Jan-1995||http://x" + "|0" * 19 + "\n") -> Path:
    folder = tmp_path / "ml"
    folder.mkdir()
    (folder / "u.data").write_text(data)
    (folder / "u.user").write_text("1|24|M|technician|85711\n")
    (folder / "u.item").write_text(item, encoding="latin-1")
    (folder / "u.genre").write_text("".join(f"g{i}|{i}\n" for i in range(19)))
    return folder


@pytest.mark.parametrize("data, item, expected", [
    ("1\t2\t5\t881250949\n1\t2\tnan\t881250950\n", None, r"u.data:2: rating 'nan' is off the MovieLens 100K"),
    ("1\t2\t5\t881250949\n1\t2\t4\n", None, r"u.data:2: not user"),
    ("1\t2\t5\t881250949\nx\t2\t4\t881250950\n", None, r"u.data:2: not user"),
    ("1\t2\t5\t881250949\n1\t2\t4\t881250950\t7\n", None, r"u.data: not user<TAB>item<TAB>rating<TAB>timestamp lines"),
    ("1\t2\t5\t881250949\n", "2|Film\n", r"u.item: 2 '\|'-separated fields, expected 24"),
], ids=["rating_nan", "short_line", "text_user", "long_line", "short_item"])
def test_a_bad_100k_line_is_one_line_naming_it(tmp_path: Path, data: str, item: str | None, expected: str):
    """The 100K files were read by pandas unchecked: a rating "nan" or a short line became label 0
    without a word, a text user id a pandas merge message, a long line a two-line C parser message,
    a short u.item line a KeyError traceback."""
    folder = _100k(tmp_path, data, *([item] if item else []))
    with pytest.raises(DataError, match=expected):
        _read(folder)


BLANK_LINES_BEFORE = {  # folder maker -> the file and line the error names
    "100k_data": (lambda d: _100k(d, "1\t2\t5\t881250949\n\n  \n1\t2\t4\t881250950\n1\tx\t4\t881250951\n"),
                  r"u.data:5: not user<TAB>item"),
    "100k_data_crlf": (lambda d: _100k(d, "1\t2\t5\t881250949\r\n\r\n1\t2\tnan\t881250950\r\n"),
                       r"u.data:3: rating 'nan' is off"),
    "100k_data_64": (lambda d: _100k(d, f"\n1\t2\t5\t881250949\n\n1\t2\t4\t{BIG}\n"), r"u.data:4: timestamp '1234"),
    "100k_user": (lambda d: (_100k(d, "1\t2\t5\t881250949\n"), (d / "ml" / "u.user").write_text(
        "1|24|M|technician|85711\n\n\nx|30|F|writer|12345\n"))[0], r"u.user:4: not user\|age"),
    "1m_rating": (lambda d: _1m(d / "ml", ratings="\n\n1::x::4::978300761\n"), r"ratings.dat:4: not user::item"),
    "20m_rating": (lambda d: _20m(d / "ml", ratings="\n \n3,2,,101\n"), r"ratings.csv:5: not userId,movieId"),
}


@pytest.mark.parametrize("case", sorted(BLANK_LINES_BEFORE))
def test_a_bad_line_after_blank_lines_is_named_by_its_own_line(tmp_path: Path, case: str):
    """pandas skips blank lines, so a bad line's row position named an earlier line of the file
    (u.data:3 for the fifth line after two blank ones); now the line itself."""
    make, expected = BLANK_LINES_BEFORE[case]
    with pytest.raises(DataError, match=expected):
        _read(make(tmp_path))


def test_a_20m_rating_missing_is_one_line_naming_it(tmp_path: Path):
    """ratings.csv was read unchecked: an empty rating became label 0 without a word."""
    (tmp_path / "ratings.csv").write_text("userId,movieId,rating,timestamp\n1,2,4.5,100\n2,2,,102\n")
    (tmp_path / "movies.csv").write_text("movieId,title,genres\n2,Film (1999),Drama\n")
    with pytest.raises(DataError, match=r"ratings.csv:3: not userId,movieId,rating,timestamp"):
        _read(tmp_path)
    (tmp_path / "ratings.csv").write_text("userId,movieId,rating,timestamp\n1,2,4.5,100\n2,2,3,102\n")
    assert _read(tmp_path).column("label").to_pylist() == [1.0, 0.0]


BIG = "123456789012345678901234567890"  # beyond 64 bits


def _1m(folder: Path, ratings: str = "", movies: str = "", users: str = "") -> Path:
    folder.mkdir()
    (folder / "ratings.dat").write_text("1::2::5::978300760\n" + ratings)
    (folder / "movies.dat").write_text("2::Film (1999)::Drama\n" + movies)
    (folder / "users.dat").write_text("1::F::25::10::48067\n" + users)
    return folder


def _20m(folder: Path, ratings: str = "", movies: str = "") -> Path:
    folder.mkdir()
    (folder / "ratings.csv").write_text("userId,movieId,rating,timestamp\n1,2,4.5,100\n" + ratings)
    (folder / "movies.csv").write_text("movieId,title,genres\n2,Film (1999),Drama\n" + movies)
    return folder


BEYOND_64_BITS = {  # folder maker -> the file, line and column the error names
    "100k_user": (lambda d: _100k(d, f"1\t2\t5\t881250949\n{BIG}\t2\t4\t881250950\n"), r"u.data:2: user '1234"),
    "100k_item": (lambda d: _100k(d, f"1\t2\t5\t881250949\n1\t{BIG}\t4\t881250950\n"), r"u.data:2: item '1234"),
    "100k_time": (lambda d: _100k(d, f"1\t2\t5\t881250949\n1\t2\t4\t{BIG}\n"), r"u.data:2: timestamp '1234"),
    "100k_u_item": (lambda d: _100k(d, "1\t2\t5\t881250949\n", f"{BIG}|Film (1995)|01-Jan-1995||http://x"
                                    + "|0" * 19 + "\n"), r"u.item:1: item '1234"),
    "1m_rating": (lambda d: _1m(d / "ml", ratings=f"1::{BIG}::4::978300761\n"), r"ratings.dat:2: item '1234"),
    "1m_movie": (lambda d: _1m(d / "ml", movies=f"{BIG}::Other (1990)::Drama\n"), r"movies.dat:2: id '1234"),
    "1m_user": (lambda d: _1m(d / "ml", users=f"{BIG}::M::25::3::12345\n"), r"users.dat:2: id '1234"),
    "20m_rating": (lambda d: _20m(d / "ml", ratings=f"-{BIG},2,3.0,101\n"), r"ratings.csv:3: user '-1234"),
    "20m_movie": (lambda d: _20m(d / "ml", movies=f"{BIG},Other (1990),Drama\n"), r"movies.csv:3: movieId '1234"),
}


@pytest.mark.parametrize("case", sorted(BEYOND_64_BITS))
def test_an_id_or_time_beyond_64_bits_is_one_line_naming_its_line(tmp_path: Path, case: str):
    """An id or timestamp beyond 64 bits in a ratings file became INT64_MIN without a word (every
    such user one user, scored by `flowrec predict` as such); in movies.dat, users.dat or
    movies.csv it was an OverflowError traceback."""
    make, expected = BEYOND_64_BITS[case]
    with pytest.raises(DataError, match=expected + r".*beyond 64 bits") as caught:
        _read(make(tmp_path))
    assert "\n" not in str(caught.value)


def test_an_age_or_occupation_code_beyond_64_bits_is_kept_as_text(tmp_path: Path):
    """1M's age and occupation codes (100K's age) are integers; one beyond 64 bits (or a fraction)
    was a TypeError traceback (100K: an OverflowError): the column is kept as text, as the CSV
    formats keep an id beyond 64 bits."""
    got = _read(_1m(tmp_path / "1m", ratings="2::2::3::978300761\n", users=f"2::M::{BIG}::2.5::12345\n"))
    assert got["age"].to_pylist() == ["25", BIG] and got["occupation"].to_pylist() == ["10", "2.5"]
    folder = _100k(tmp_path, "1\t2\t5\t881250949\n")
    (folder / "u.user").write_text(f"1|{BIG}|M|technician|85711\n")
    assert _read(folder)["age"].to_pylist() == [BIG]
    assert _read(_1m(tmp_path / "ok"))["age"].to_pylist() == [25]  # whole codes stay integers


def test_an_id_of_a_digit_sign_that_is_no_number_is_one_line(tmp_path: Path):
    """Latin-1's superscript two passed str.isdigit as an id of users.dat / movies.dat, then was
    pandas' ValueError traceback."""
    folder = _1m(tmp_path / "ml")
    with open(folder / "users.dat", "ab") as f:
        f.write(b"\xb2::M::25::3::12345\n")
    with pytest.raises(DataError, match=r"users.dat:2: "):
        _read(folder)


@pytest.mark.parametrize("kind", ["folder", "pipe", "broken link"])
def test_a_release_file_that_is_no_file_or_missing_is_named(tmp_path: Path, kind: str):
    """A 100K folder whose u.data was a folder (a pipe, a broken link) was 'not a MovieLens folder: it
    lacks the files of every release', naming no file; one missing u.user listed every release's
    files, not the one it lacked."""
    import os

    for name in ("u.data", "u.user", "u.item", "u.genre"):
        (tmp_path / name).write_text("")
    (tmp_path / "u.data").unlink()
    {"folder": lambda p: p.mkdir(), "pipe": os.mkfifo, "broken link": lambda p: p.symlink_to(tmp_path / "gone")}[kind](
        tmp_path / "u.data")
    with pytest.raises(DataError, match=rf"^{tmp_path / 'u.data'} is a {kind}.*, not a file: "
                                        r"the MovieLens 100K release's u.data is a file"):
        movielens_release(tmp_path)
    (tmp_path / "u.data").rmdir() if kind == "folder" else (tmp_path / "u.data").unlink()
    (tmp_path / "u.data").write_text("")
    (tmp_path / "u.user").unlink()
    with pytest.raises(DataError, match=rf"^{tmp_path} is not a MovieLens folder: it lacks u\.user of the 100K release "
                                        r"\(the files of every release: 100K: u\.data"):
        movielens_release(tmp_path)


OFF_SCALE = [  # (release, rating): whole stars 1-5 in 100K and 1M, half stars 0.5-5 in 10M and later
    ("100K", "0"), ("100K", "6"), ("100K", "-3"), ("100K", "4.5"), ("100K", "nan"), ("1M", "4.5"), ("1M", "0"),
    ("1M", "NaN"), ("10M", "0"), ("10M", "5.5"), ("10M", "4.25"), ("10M", "-3"), ("20M+", "6"), ("20M+", "0.25"),
    ("20M+", "0"), ("20M+", "nan"), ("20M+", "inf"),
]
SCALES = {"100K": "whole stars 1 to 5", "1M": "whole stars 1 to 5", "10M": "half stars 0.5 to 5",
          "20M+": "half stars 0.5 to 5"}


def _release(folder: Path, release: str, ratings: list[str]) -> Path:
    """A folder of `release` whose ratings file holds `ratings` (users 1-3, items 2-3), after a blank line."""
    rows = [(1 + i % 3, 2 + i % 2, r, 881250949 + i) for i, r in enumerate(ratings)]
    if release == "100K":
        return _100k(folder.parent, "\n" + "".join(f"{u}\t{m}\t{r}\t{t}\n" for u, m, r, t in rows),
                     "2|Film (1995)|01-Jan-1995||http://x" + "|0" * 19 + "\n3|Other (1996)|01-Jan-1996||http://y"
                     + "|0" * 19 + "\n")
    folder.mkdir()
    if release == "20M+":
        (folder / "ratings.csv").write_text("userId,movieId,rating,timestamp\n\n"
                                            + "".join(f"{u},{m},{r},{t}\n" for u, m, r, t in rows))
        (folder / "movies.csv").write_text("movieId,title,genres\n2,Film (1995),Drama\n3,Other (1996),Comedy\n")
        return folder
    (folder / "ratings.dat").write_text("\n" + "".join(f"{u}::{m}::{r}::{t}\n" for u, m, r, t in rows))
    (folder / "movies.dat").write_text("2::Film (1995)::Drama\n3::Other (1996)::Comedy\n")
    if release == "1M":
        (folder / "users.dat").write_text("1::F::25::10::48067\n2::M::1::3::12345\n3::F::56::1::54321\n")
    return folder


@pytest.mark.parametrize("release, rating", OFF_SCALE, ids=[f"{r}_{v}" for r, v in OFF_SCALE])
def test_a_rating_off_its_releases_scale_is_one_line_naming_it(tmp_path: Path, release: str, rating: str):
    """A rating of 0, 6, -3, nan, or 4.5 where the release rates in whole stars, was read as a
    rating and turned into a label (rating >= 4) without a word. It is one line naming the file,
    the line (a blank one before it counted), the value and the release's scale; `data convert`
    of such a folder writes nothing."""
    rng = np.random.default_rng()
    good = [str(v) for v in rng.integers(1, 6, int(rng.integers(3, 30)))]
    bad = int(rng.integers(0, len(good) + 1))
    folder = _release(tmp_path / "ml", release, good[:bad] + [rating] + good[bad:])
    assert movielens_release(folder) == release
    name = {"100K": "u.data", "20M+": "ratings.csv"}.get(release, "ratings.dat")
    line = bad + 2 + (release == "20M+")  # the blank line first, the header before it
    expected = (f"{folder / name}:{line}: rating {rating!r} is off the MovieLens {release} release's scale "
                f"({SCALES[release]})")
    with pytest.raises(DataError) as info:
        _read(folder)
    assert str(info.value) == expected
    out = tmp_path / "out"
    with pytest.raises(DataError) as info:
        convert(load_spec(Path(__file__).parents[2] / "specs" / "movielens.yaml"), "movielens", [folder], out)
    assert str(info.value) == expected and not out.exists()


@pytest.mark.parametrize("release", ["10M", "20M+"])
def test_half_stars_are_read_where_the_release_rates_in_them(tmp_path: Path, release: str):
    """10M and later rate in half stars, 0.5 to 5: every one of them is a rating (4.5 a liked one)."""
    stars = [f"{0.5 * k:g}" for k in range(1, 11)]
    got = _read(_release(tmp_path / "ml", release, stars))
    assert got["rating"].to_pylist() == [0.5 * k for k in range(1, 11)]
    assert got["label"].to_pylist() == [float(k >= 8) for k in range(1, 11)]


ITEM_100K = "|Film (1995)|01-Jan-1995||http://x" + "|0" * 19 + "\n"
GIVEN_AGAIN = {  # folder maker -> (file, line of the id again, the id, its first line, user or movie)
    "100k_user": (lambda d: (_100k(d, "1\t2\t5\t881250949\n"), (d / "ml" / "u.user").write_text(
        "1|24|M|technician|85711\n2|30|F|writer|12345\n\n1|53|F|other|54321\n"))[0], "u.user", 4, 1, 1, "user"),
    "100k_item": (lambda d: _100k(d, "1\t2\t5\t881250949\n", f"2{ITEM_100K}3{ITEM_100K}2{ITEM_100K}"),
                  "u.item", 3, 2, 1, "movie"),
    "1m_user": (lambda d: _1m(d / "ml", users="3::M::1::3::12345\n1::M::25::3::12345\n"), "users.dat", 3, 1, 1, "user"),
    "1m_movie": (lambda d: _1m(d / "ml", movies="\n02::Film again (2001)::Comedy\n"), "movies.dat", 3, 2, 1, "movie"),
    "20m_movie": (lambda d: _20m(d / "ml", movies="5,Other (1990),Drama\n2,Film again (2001),Comedy\n"),
                  "movies.csv", 4, 2, 2, "movie"),
}


@pytest.mark.parametrize("case", sorted(GIVEN_AGAIN))
def test_a_user_or_movie_given_twice_is_one_line_naming_both_lines(tmp_path: Path, case: str):
    """A users or movies file giving an id on two lines was joined to the ratings as it stood: each
    rating of that user or movie became one row per line (2 ratings were 4 rows, their line numbers
    shifted), without a word. It is one line naming the file, both lines and the id."""
    make, name, line, key, first, what = GIVEN_AGAIN[case]
    folder = make(tmp_path)
    with pytest.raises(DataError) as info:
        _read(folder)
    assert str(info.value) == (f"{folder / name}:{line}: {what} {key} again (its line {first} gives it first): a "
                               f"{what} is one line, or its ratings would be read once for each")
