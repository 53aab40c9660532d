"""A `ctitan prepare` that fails before its first whole shard left the --out folder it had
created, empty (and every parent it created on the way): a later look at it, or a tool that
takes any folder for data, saw a dataset that is not there. It now removes the folders it
created, where they are empty; a folder that was there before stays, as whole shards of a
prepare that failed later do (an interrupted prepare, test_data_integrity.py)."""
import pytest

from test_data_hf import tokdir  # noqa: F401  (fixture)


@pytest.fixture
def bad_jsonl(tmp_path):
    # the second line is not JSON (json.loads refuses it): prepare fails after opening --out
    import json
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"text": "hello world"}) + '\n{"text": "cut"\n')
    with pytest.raises(json.JSONDecodeError):
        json.loads(p.read_text().splitlines()[1])
    return p


def _prepare(run_ctitan, tokdir, src, out):  # noqa: F811
    rc, _, err = run_ctitan(["prepare", "--tokenizer", tokdir, "--input", src, "--out", out, "--quiet"],
                            check=False)
    assert rc == 3 and "invalid JSON" in err and f"{src}:2" in err, (rc, err)


def test_a_failed_prepare_removes_the_folders_it_created(tmp_path, run_ctitan, tokdir, bad_jsonl):  # noqa: F811
    out = tmp_path / "new" / "nested" / "out"
    _prepare(run_ctitan, tokdir, bad_jsonl, out)
    assert not (tmp_path / "new").exists(), sorted(str(p) for p in (tmp_path / "new").rglob("*"))
    assert bad_jsonl.exists() and tokdir.exists()


def test_a_failed_prepare_keeps_a_folder_that_was_there(tmp_path, run_ctitan, tokdir, bad_jsonl):  # noqa: F811
    out = tmp_path / "there"
    out.mkdir()
    _prepare(run_ctitan, tokdir, bad_jsonl, out)
    assert out.is_dir() and not list(out.iterdir())
    # a parent that was there stays; the folder under it that prepare made goes
    _prepare(run_ctitan, tokdir, bad_jsonl, out / "sub" / "")
    assert out.is_dir() and not list(out.iterdir())
