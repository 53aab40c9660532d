"""Hub ids (`org/tiny`) wherever ctitan takes a model directory, against a fake Hub on
loopback that speaks the Hub's protocol: /{repo}/resolve/{revision}/{file} with
X-Repo-Commit, ETag (git blob sha1) for regular files, and for LFS files (*.safetensors)
a 302 to a CDN on another origin with X-Linked-Etag (sha256) and X-Linked-Size; the CDN
serves Range requests. X-Error-Code RepoNotFound / GatedRepo / RevisionNotFound /
EntryNotFound as the Hub sends them.

ctitan fills the cache given by HF_HUB_CACHE; then huggingface_hub (scan_cache_dir,
hf_hub_download(local_files_only=True)) and transformers (from_pretrained(...,
local_files_only=True)) must read that cache as their own. Faults: a connection dropped
mid-file (resumed with Range), a connection that never delivers (error after retries), a
corrupt file (refused, nothing cached as complete), 401, 404, offline with and without a
cache, a revision other than main, a sharded model."""
from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import pytest
import torch

import oracle
from conftest import CHILD_ENV, ROOT, crashed, run_on_pty
from test_generate import CORPUS, QWEN_PATTERN, SPECIALS

V = 300  # the model's vocabulary: the tokenizer's


# ----------------------------------------------------------------------------- fake Hub


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Repo:
    """Commits (commit -> {file: bytes}) and branches (name -> commit) of one model repo."""

    def __init__(self, private=False, gated=False):
        self.commits: dict[str, dict[str, bytes]] = {}
        self.refs: dict[str, str] = {}
        self.private, self.gated = private, gated

    def commit(self, files: dict[str, bytes], branch="main") -> str:
        h = hashlib.sha1(repr(sorted((k, hashlib.sha256(v).hexdigest()) for k, v in files.items())).encode()
                         + branch.encode()).hexdigest()
        self.commits[h] = dict(files)
        self.refs[branch] = h
        return h


class FakeHub:
    """Two ThreadingHTTPServers on 127.0.0.1 (random ports): the Hub, and a CDN on another
    origin for LFS files. Faults are set per test: drop_after[file] = n (the next GET of
    that file sends n bytes, then closes the connection; once), never[file] (every GET
    closes before a byte), corrupt[file] (the bytes served differ from the etag),
    ignore_range[file] (a GET with Range gets 200 and the whole file; once), wrong_range[file]
    (a GET with Range gets 206 from byte 0 instead; once)."""

    TOKEN = "hf_test_token_123"

    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.blobs: dict[str, bytes] = {}  # sha256 -> bytes, for the CDN
        self.log: list[tuple[str, str, str, dict]] = []  # (server, method, path, headers)
        self.drop_after: dict[str, int] = {}
        self.never: set[str] = set()
        self.corrupt: set[str] = set()
        self.ignore_range: set[str] = set()
        self.wrong_range: set[str] = set()
        self.lock = threading.Lock()
        self.hub = ThreadingHTTPServer(("127.0.0.1", 0), self._handler("hub"))
        self.cdn = ThreadingHTTPServer(("127.0.0.1", 0), self._handler("cdn"))
        self.url = f"http://127.0.0.1:{self.hub.server_address[1]}"
        self.cdn_url = f"http://127.0.0.1:{self.cdn.server_address[1]}"
        for s in (self.hub, self.cdn):
            s.daemon_threads = True
            threading.Thread(target=s.serve_forever, daemon=True).start()

    def close(self):
        for s in (self.hub, self.cdn):
            s.shutdown()
            s.server_close()

    def add_dir(self, repo_id: str, d: Path, branch="main", **kw) -> str:
        repo = self.repos.setdefault(repo_id, Repo(**kw))
        files = {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}
        for name, data in files.items():
            if name.endswith(".safetensors"):
                self.blobs[hashlib.sha256(data).hexdigest()] = data
        return repo.commit(files, branch)

    def requests(self, server=None, method=None, contains=""):
        with self.lock:
            return [r for r in self.log if (server is None or r[0] == server) and (method is None or r[1] == method)
                    and contains in r[2]]

    def _handler(self, which):
        hub = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_HEAD(self):
                self._serve(head=True)

            def do_GET(self):
                self._serve(head=False)

            def _send(self, code, headers, body=b"", head=False):
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, str(v))
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head and body:
                    self.wfile.write(body)

            def _error(self, code, err, message, head, commit=None):
                h = {"X-Error-Code": err, "X-Error-Message": message}
                if commit:
                    h["X-Repo-Commit"] = commit
                self._send(code, h, message.encode(), head)

            def _serve(self, head):
                with hub.lock:
                    hub.log.append((which, self.command, self.path, dict(self.headers)))
                if which == "cdn":
                    return self._cdn(head)
                m = re.fullmatch(r"/([^/]+)/([^/]+)/resolve/([^/]+)/(.+)", self.path.split("?")[0])
                if not m:
                    return self._send(404, {}, b"not found", head)
                repo_id, rev, file = f"{m[1]}/{m[2]}", unquote(m[3]), unquote(m[4])
                repo = hub.repos.get(repo_id)
                auth = self.headers.get("Authorization")
                authed = auth == f"Bearer {hub.TOKEN}"
                if repo is None or (repo.private and not authed):
                    return self._error(404 if auth is None and repo is None else 401, "RepoNotFound",
                                       "Repository not found", head)
                if repo.gated and not authed:
                    return self._error(401 if auth is None else 403, "GatedRepo",
                                       "Access to this model is restricted", head)
                commit = rev if rev in repo.commits else repo.refs.get(rev)
                if commit is None:
                    return self._error(404, "RevisionNotFound", "Invalid rev id", head)
                files = repo.commits[commit]
                if file not in files:
                    return self._error(404, "EntryNotFound", f"{file} does not exist", head, commit)
                data = files[file]
                if file.endswith(".safetensors"):  # LFS: the Hub answers with a redirect to its CDN
                    sha = hashlib.sha256(data).hexdigest()
                    pointer = (f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\n"
                               f"size {len(data)}\n").encode()
                    return self._send(302, {"X-Repo-Commit": commit, "X-Linked-Etag": f'"{sha}"',
                                            "X-Linked-Size": len(data), "ETag": f'"{git_blob_sha1(pointer)}"',
                                            "Location": f"{hub.cdn_url}/cdn/{sha}?file={file}",
                                            "Content-Length": 0}, b"", True)
                body = data
                if file in hub.corrupt:
                    body = data[:-2] + b"!!"
                self._body(head, {"X-Repo-Commit": commit, "ETag": f'"{git_blob_sha1(data)}"'}, body, file)

            def _cdn(self, head):
                m = re.fullmatch(r"/cdn/([0-9a-f]{64})\?file=(.+)", self.path)
                if not m or m[1] not in hub.blobs:
                    return self._send(404, {}, b"no such object", head)
                data, file = hub.blobs[m[1]], unquote(m[2])
                if file in hub.corrupt:
                    data = bytes([data[0] ^ 1]) + data[1:]
                self._body(head, {"ETag": f'"{m[1]}"', "Accept-Ranges": "bytes"}, data, file)

            def _body(self, head, headers, data, file):
                """200 or (with Range) 206, with the faults set for `file`."""
                start, code = 0, 200
                rng = self.headers.get("Range")
                ignore = wrong = False
                if rng and not head:
                    with hub.lock:  # each fault once
                        if file in hub.ignore_range:
                            hub.ignore_range.discard(file)
                            ignore = True
                        elif file in hub.wrong_range:
                            hub.wrong_range.discard(file)
                            wrong = True
                if ignore:
                    rng = None
                if rng and not head:
                    mm = re.fullmatch(r"bytes=(\d+)-", rng)
                    start = 0 if wrong else int(mm[1])
                    if start >= len(data):
                        return self._send(416, {"Content-Range": f"bytes */{len(data)}"}, b"", head)
                    code = 206
                    headers = dict(headers, **{"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"})
                part = data[start:]
                if head:
                    return self._send(code, dict(headers, **{"Content-Length": len(part)}), b"", True)
                cut = None
                with hub.lock:
                    if file in hub.never:
                        cut = 0
                    elif file in hub.drop_after:
                        cut = hub.drop_after.pop(file)
                if cut is None:
                    return self._send(code, headers, part)
                self.send_response(code)
                for k, v in dict(headers, **{"Content-Length": len(part)}).items():
                    self.send_header(k, str(v))
                self.end_headers()
                self.wfile.write(part[:cut])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)

        return H


# ----------------------------------------------------------------------------- fixtures


def write_bpe_tokenizer(d: Path):
    """A Qwen-style byte-level BPE of V tokens, with the two JSON side files."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=V, special_tokens=SPECIALS, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tk.get_vocab_size() == V, tk.get_vocab_size()
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": 256,
        "tokenizer_class": "Qwen2Tokenizer"}))
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return tk


def tiny_dir(d: Path, seed=0, shard=None):
    cfg = oracle.tiny_config(vocab=V, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=16)
    model = oracle.build_model(cfg, seed=seed)
    oracle.save_model(model, d, max_shard_size=shard)
    write_bpe_tokenizer(d)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Local HF directories: main (seed 1), v2 (seed 2), a sharded one (seed 3)."""
    base = tmp_path_factory.mktemp("hub_models")
    out = {}
    for name, seed, shard in (("main", 1, None), ("v2", 2, None), ("sharded", 3, "100KB")):
        out[name] = base / name
        tiny_dir(out[name], seed=seed, shard=shard)
    assert len(list(out["sharded"].glob("model-*.safetensors"))) >= 2, "the sharded model has fewer than 2 shards"
    return out


@pytest.fixture
def fake_hub(models):
    hub = FakeHub()
    hub.add_dir("org/tiny", models["main"])
    hub.add_dir("org/tiny", models["v2"], branch="v2")
    hub.add_dir("org/sharded", models["sharded"])
    hub.add_dir("org/private", models["main"], private=True)
    hub.add_dir("org/gated", models["main"], gated=True)
    yield hub
    hub.close()


def hub_env(cache: Path, hub: FakeHub | None = None, **extra) -> dict:
    env = {k: v for k, v in CHILD_ENV.items()
           if not k.startswith(("HF_", "HUGGING")) and k != "TRANSFORMERS_OFFLINE"}
    env["HF_HUB_CACHE"] = str(cache)
    env["HF_HOME"] = str(cache.parent / "hf_home")  # no token file of the machine's
    env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    env["HF_ENDPOINT"] = hub.url if hub else "http://127.0.0.1:9"  # port 9: nothing listens
    env.update(extra)
    return env


@pytest.fixture
def ctitan(ctitan_bin):
    def _run(args, env, expect=0, timeout=180):
        cmd = [str(ctitan_bin)] + [str(a) for a in args]
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        crashed(p.returncode, p.stderr, cmd)
        assert p.returncode == expect, (f"exit {p.returncode}, expected {expect}: {' '.join(cmd)}\n"
                                        f"--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}")
        return p.stdout, p.stderr

    return _run


def snapshot(cache: Path, repo: str, commit: str) -> Path:
    return cache / f"models--{repo.replace('/', '--')}" / "snapshots" / commit


def assert_cache_valid(cache: Path, repo: str, ref: str, commit: str, files: set[str]):
    """The layout huggingface_hub writes, and huggingface_hub agrees: no warnings, the
    files, the ref, every file a relative link to blobs/<etag>."""
    from huggingface_hub import scan_cache_dir
    info = scan_cache_dir(cache)
    assert not info.warnings, f"scan_cache_dir warnings: {info.warnings}"
    repos = {r.repo_id: r for r in info.repos}
    assert repo in repos, f"{repo} not in the scanned cache: {list(repos)}"
    revs = {r.commit_hash: r for r in repos[repo].revisions}
    assert commit in revs, f"{commit} not among {list(revs)}"
    assert ref in revs[commit].refs, f"ref {ref} not on {commit}: {revs[commit].refs}"
    assert files <= {f.file_name for f in revs[commit].files}, {f.file_name for f in revs[commit].files}
    root = cache / f"models--{repo.replace('/', '--')}"
    assert (root / "refs" / ref).read_text() == commit
    for f in files:
        link = root / "snapshots" / commit / f
        assert link.is_symlink(), f"{link} is not a symlink"
        target = os.readlink(link)
        assert target.startswith("../../blobs/"), target
        blob = (link.parent / target).resolve()
        assert blob.is_file() and blob.parent == (root / "blobs").resolve()
    assert not list((root / "blobs").glob("*.incomplete")), "an .incomplete file was left behind"


def sha256_of(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


GEN = ["--prompt-ids", "1 2 3", "--max-tokens", "4", "--ids"]


def hf_greedy(model_dir: Path) -> str:
    """What `ctitan generate` prints for GEN from a local directory (the reference)."""
    bin_ = ROOT / os.environ.get("CTITAN_BUILD", "build") / "ctitan"
    p = subprocess.run([str(bin_), "generate", "--checkpoint", str(model_dir), *GEN], env=CHILD_ENV,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout


# ----------------------------------------------------------------------------- tests


def test_download_generate_import_then_hf_reads_the_cache(tmp_path, fake_hub, models, ctitan):
    cache = tmp_path / "cache"
    env = hub_env(cache, fake_hub)
    commit = fake_hub.repos["org/tiny"].refs["main"]

    # generate --checkpoint ID: downloads config, tokenizer, weights; same tokens as the local dir
    out, err = ctitan(["generate", "--checkpoint", "org/tiny", *GEN], env)
    assert out == hf_greedy(models["main"]), (out, err)
    files = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
             "tokenizer_config.json", "special_tokens_map.json"}
    assert_cache_valid(cache, "org/tiny", "main", commit, files)
    snap = snapshot(cache, "org/tiny", commit)
    for f in files:
        assert (snap / f).read_bytes() == (models["main"] / f).read_bytes(), f
    # the LFS file came from the CDN, without the token's header there; the HEADs asked for identity
    assert fake_hub.requests("cdn", "GET"), "the weights were not fetched from the CDN"
    heads = fake_hub.requests("hub", "HEAD")
    assert heads and all(r[3].get("Accept-Encoding") == "identity" for r in heads)
    # every file after the first was asked for at the commit the first HEAD gave
    assert all(f"/resolve/{commit}/" in r[2] for r in heads[1:]), [r[2] for r in heads]

    # a second run: everything cached, no GET at all
    n_get = len(fake_hub.requests(method="GET"))
    ctitan(["generate", "--checkpoint", "org/tiny", *GEN], env)
    assert len(fake_hub.requests(method="GET")) == n_get

    # import --hf ID: the checkpoint records the id and the commit it came from
    ck = tmp_path / "ck"
    out, _ = ctitan(["import", "--hf", "org/tiny", "--out", ck], env)
    toml = (ck / "step-0" / "config.toml").read_text()
    assert 'hf_assets_path = "org/tiny"' in toml and f'hf_revision = "{commit}"' in toml, toml
    # export finds the tokenizer files through the id + commit, offline from the cache
    hf_out = tmp_path / "exported"
    ctitan(["export", "--checkpoint", ck / "step-0", "--out", hf_out], dict(env, HF_HUB_OFFLINE="1"))
    assert (hf_out / "tokenizer.json").read_bytes() == (models["main"] / "tokenizer.json").read_bytes()

    # huggingface_hub and transformers read the cache as their own, offline
    from huggingface_hub import hf_hub_download
    from transformers import AutoModelForCausalLM, AutoTokenizer
    p = hf_hub_download("org/tiny", "model.safetensors", cache_dir=str(cache), local_files_only=True)
    assert sha256_of(Path(p)) == sha256_of(models["main"] / "model.safetensors")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        m = AutoModelForCausalLM.from_pretrained("org/tiny", cache_dir=str(cache), local_files_only=True,
                                                 dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained("org/tiny", cache_dir=str(cache), local_files_only=True)
    finally:
        del os.environ["HF_HUB_OFFLINE"]
    want = oracle.load_hf(models["main"])
    for (k, a), (_, b) in zip(m.state_dict().items(), want.state_dict().items()):
        assert torch.equal(a, b), k
    from tokenizers import Tokenizer
    want_tok = Tokenizer.from_file(str(models["main"] / "tokenizer.json"))
    assert tok("hello world")["input_ids"] == want_tok.encode("hello world").ids


def test_train_with_hub_id(tmp_path, fake_hub, models, ctitan):
    """model.hf_assets_path and checkpoint.initial_load_path = the id: step-1 loss equals the
    one from the local directory."""
    cache = tmp_path / "cache"
    data = oracle.write_bin(tmp_path / "d.bin", oracle.random_tokens(4 * 17, V, seed=5))
    losses = {}
    for name, src in (("local", models["main"]), ("hub", "org/tiny")):
        sections = oracle.train_sections(tmp_path / f"out_{name}", data, src, steps=1)
        conf = oracle.write_toml(tmp_path / f"{name}.toml", sections)
        ctitan(["train", "--config", conf], hub_env(cache, fake_hub))
        losses[name] = oracle.read_metrics(tmp_path / f"out_{name}" / "metrics.jsonl")[0]["loss"]
        # the run's config keeps what the user wrote (the id), not the cache path
        assert str(src) in (tmp_path / f"out_{name}" / "config.toml").read_text()
    assert losses["hub"] == losses["local"], losses
    commit = fake_hub.repos["org/tiny"].refs["main"]
    assert_cache_valid(cache, "org/tiny", "main", commit, {"config.json", "model.safetensors"})
    # --dry-run reads config.json only
    dry = tmp_path / "cache_dry"
    ctitan(["train", "--config", tmp_path / "hub.toml", "--dry-run"], hub_env(dry, fake_hub))
    assert {p.name for p in snapshot(dry, "org/tiny", commit).iterdir()} <= {"config.json", "generation_config.json"}
    # random init from the Hub's config.json on text, tokenized with the Hub's tokenizer: no weights fetched
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(CORPUS))
    scratch = tmp_path / "cache_scratch"
    sections = oracle.train_sections(tmp_path / "out_text", text, "org/tiny", load=False, steps=1,
                                     options={"training.dataset": "text", "training.text_split": "paragraph"})
    ctitan(["train", "--config", oracle.write_toml(tmp_path / "text.toml", sections)], hub_env(scratch, fake_hub))
    have = {p.name for p in snapshot(scratch, "org/tiny", commit).iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= have and "model.safetensors" not in have, have


def test_revision_other_than_main(tmp_path, fake_hub, models, ctitan):
    cache = tmp_path / "cache"
    env = hub_env(cache, fake_hub)
    out, _ = ctitan(["generate", "--checkpoint", "org/tiny", "--revision", "v2", *GEN], env)
    assert out == hf_greedy(models["v2"])
    v2 = fake_hub.repos["org/tiny"].refs["v2"]
    assert_cache_valid(cache, "org/tiny", "v2", v2, {"config.json", "model.safetensors"})
    assert not (cache / "models--org--tiny" / "refs" / "main").exists()
    # a commit as the revision: offline, straight from the snapshot
    out2, _ = ctitan(["generate", "--checkpoint", "org/tiny", "--revision", v2, *GEN], dict(env, HF_HUB_OFFLINE="1"))
    assert out2 == out
    # train with model.hf_revision
    data = oracle.write_bin(tmp_path / "d.bin", oracle.random_tokens(4 * 17, V, seed=5))
    losses = []
    for name, src, rev in (("local", models["v2"], None), ("hub", "org/tiny", "v2")):
        opts = {"model.hf_revision": rev} if rev else {}
        sections = oracle.train_sections(tmp_path / f"o_{name}", data, src, steps=1, options=opts)
        ctitan(["train", "--config", oracle.write_toml(tmp_path / f"{name}.toml", sections)], env)
        losses.append(oracle.read_metrics(tmp_path / f"o_{name}" / "metrics.jsonl")[0]["loss"])
    assert losses[0] == losses[1], losses
    # a revision the repo does not have
    _, err = ctitan(["generate", "--checkpoint", "org/tiny", "--revision", "nope", *GEN], env, expect=2)
    assert "org/tiny" in err and "RevisionNotFound" in err and "nope" in err, err


def test_commit_revision_writes_no_ref(tmp_path, fake_hub, models, ctitan):
    """A 40-hex commit as the revision: the snapshot is filled and no refs/<commit> is
    written, as huggingface_hub does (file_download._cache_commit_hash_for_specific_revision
    writes refs/<revision> only when the revision is not the commit). huggingface_hub itself,
    downloading from the same fake Hub at that commit into another cache, is the reference."""
    commit = fake_hub.repos["org/tiny"].refs["v2"]
    cache = tmp_path / "cache"
    out, _ = ctitan(["download", "org/tiny", "--revision", commit], hub_env(cache, fake_hub))
    assert out.strip() == str(snapshot(cache, "org/tiny", commit))
    assert (snapshot(cache, "org/tiny", commit) / "config.json").is_file()
    ref_cache = tmp_path / "hf_cache"
    code = ("import sys; from huggingface_hub import hf_hub_download; "
            "hf_hub_download('org/tiny', 'config.json', revision=sys.argv[1])")
    p = subprocess.run([sys.executable, "-c", code, commit], env=hub_env(ref_cache, fake_hub), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert (snapshot(ref_cache, "org/tiny", commit) / "config.json").is_file()

    def refs(c):
        d = c / "models--org--tiny" / "refs"
        return sorted(f.name for f in d.iterdir()) if d.is_dir() else []
    assert refs(ref_cache) == [], refs(ref_cache)  # huggingface_hub's verdict
    assert refs(cache) == refs(ref_cache), refs(cache)


def test_sharded_model(tmp_path, fake_hub, models, ctitan):
    cache = tmp_path / "cache"
    out, _ = ctitan(["generate", "--checkpoint", "org/sharded", *GEN], hub_env(cache, fake_hub))
    assert out == hf_greedy(models["sharded"])
    commit = fake_hub.repos["org/sharded"].refs["main"]
    shards = {p.name for p in models["sharded"].glob("model-*.safetensors")}
    assert len(shards) >= 2
    assert_cache_valid(cache, "org/sharded", "main", commit, {"model.safetensors.index.json", *shards})
    assert not (snapshot(cache, "org/sharded", commit) / "model.safetensors").exists()
    # the absence of model.safetensors is recorded as huggingface_hub records it
    assert (cache / "models--org--sharded" / ".no_exist" / commit / "model.safetensors").exists()


def test_dropped_connection_resumes_with_range(tmp_path, fake_hub, models, ctitan):
    cache = tmp_path / "cache"
    size = (models["main"] / "model.safetensors").stat().st_size
    fake_hub.drop_after["model.safetensors"] = size // 3
    out, err = ctitan(["generate", "--checkpoint", "org/tiny", *GEN], hub_env(cache, fake_hub))
    assert out == hf_greedy(models["main"])
    gets = fake_hub.requests("cdn", "GET")
    assert len(gets) == 2, [g[2] for g in gets]
    assert "Range" not in gets[0][3] and gets[1][3].get("Range") == f"bytes={size // 3}-", gets[1][3]
    assert "resuming" in err, err
    commit = fake_hub.repos["org/tiny"].refs["main"]
    p = snapshot(cache, "org/tiny", commit) / "model.safetensors"
    assert sha256_of(p) == sha256_of(models["main"] / "model.safetensors")
    assert_cache_valid(cache, "org/tiny", "main", commit, {"model.safetensors"})


@pytest.mark.parametrize("fault", ["ignore_range", "wrong_range"])
def test_resume_when_the_server_does_not_honour_range(tmp_path, fake_hub, models, ctitan, fault):
    """After a dropped connection, the resuming GET's answer is not the range asked for:
    200 with the whole file (a server that ignores Range), or 206 from another byte. What
    was kept is not the file's head, so ctitan starts again from byte 0, and the cached
    file is the published one (its sha256 checked against the etag)."""
    cache = tmp_path / "cache"
    size = (models["main"] / "model.safetensors").stat().st_size
    fake_hub.drop_after["model.safetensors"] = size // 3
    getattr(fake_hub, fault).add("model.safetensors")
    out, err = ctitan(["generate", "--checkpoint", "org/tiny", *GEN], hub_env(cache, fake_hub))
    assert out == hf_greedy(models["main"])
    gets = fake_hub.requests("cdn", "GET")
    assert gets[1][3].get("Range") == f"bytes={size // 3}-", gets[1][3]
    if fault == "ignore_range":  # the 200's body is taken from its first byte, in the same GET
        assert len(gets) == 2, [g[3] for g in gets]
    else:  # the 206 from byte 0 is refused, and the next GET asks for the whole file
        assert len(gets) == 3 and "Range" not in gets[2][3], [g[3] for g in gets]
        assert "another range than bytes=" in err, err
    commit = fake_hub.repos["org/tiny"].refs["main"]
    p = snapshot(cache, "org/tiny", commit) / "model.safetensors"
    assert sha256_of(p) == sha256_of(models["main"] / "model.safetensors")
    assert_cache_valid(cache, "org/tiny", "main", commit, {"model.safetensors"})


def test_lost_connection_after_retries(tmp_path, fake_hub, ctitan):
    cache = tmp_path / "cache"
    fake_hub.never.add("model.safetensors")
    t0 = time.time()
    _, err = ctitan(["import", "--hf", "org/tiny", "--out", tmp_path / "ck"], hub_env(cache, fake_hub), expect=1)
    assert "org/tiny" in err and "model.safetensors" in err and "connection" in err and "5 retries" in err, err
    assert len(fake_hub.requests("cdn", "GET")) == 6 and time.time() - t0 < 60
    blobs = cache / "models--org--tiny" / "blobs"
    assert not [p for p in blobs.iterdir() if len(p.name) == 64], "a weights blob exists after a failed download"
    assert not (tmp_path / "ck").exists()


def test_corrupt_file_is_rejected(tmp_path, fake_hub, ctitan):
    cache = tmp_path / "cache"
    env = hub_env(cache, fake_hub)
    fake_hub.corrupt.add("model.safetensors")
    _, err = ctitan(["generate", "--checkpoint", "org/tiny", *GEN], env, expect=1)
    assert "org/tiny" in err and "model.safetensors" in err and "sha256" in err and "corrupt" in err, err
    root = cache / "models--org--tiny"
    commit = fake_hub.repos["org/tiny"].refs["main"]
    assert not (snapshot(cache, "org/tiny", commit) / "model.safetensors").exists()
    assert not list((root / "blobs").glob("*.incomplete"))
    big = [p for p in (root / "blobs").iterdir() if len(p.name) == 64]
    assert not big, f"a corrupt blob was cached: {big}"
    # once the server is right again, the same cache completes
    fake_hub.corrupt = set()
    ctitan(["generate", "--checkpoint", "org/tiny", *GEN], env)
    assert_cache_valid(cache, "org/tiny", "main", commit, {"model.safetensors", "tokenizer.json"})
    # a regular file (its etag: git's blob sha1) corrupt, in a fresh cache
    cache2 = tmp_path / "cache2"
    fake_hub.corrupt = {"tokenizer.json"}
    _, err = ctitan(["generate", "--checkpoint", "org/tiny", *GEN], hub_env(cache2, fake_hub), expect=1)
    assert "tokenizer.json" in err and "git blob sha1" in err and "corrupt" in err, err
    assert not (snapshot(cache2, "org/tiny", commit) / "tokenizer.json").exists()
    assert not list((cache2 / "models--org--tiny" / "blobs").glob("*.incomplete"))


def test_write_failure_caches_nothing(tmp_path, fake_hub, ctitan_bin):
    """A write that fails mid-file (RLIMIT_FSIZE: EFBIG, standing in for a full disk): exit 1
    naming the file and the reason, the partial file removed, no blob, no link."""
    import resource
    import signal

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    cache = tmp_path / "cache"
    p = subprocess.run([str(ctitan_bin), "download", "org/tiny"], env=hub_env(cache, fake_hub), capture_output=True,
                       text=True, timeout=120, preexec_fn=limit)
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert "org/tiny" in p.stderr and "model.safetensors" in p.stderr and "File too large" in p.stderr, p.stderr
    root = cache / "models--org--tiny"
    commit = fake_hub.repos["org/tiny"].refs["main"]
    assert not (snapshot(cache, "org/tiny", commit) / "model.safetensors").exists()
    assert not list((root / "blobs").glob("*.incomplete"))
    assert not [b for b in (root / "blobs").iterdir() if len(b.name) == 64]


def test_unknown_repo_404(tmp_path, fake_hub, ctitan):
    _, err = ctitan(["generate", "--checkpoint", "org/nothing", *GEN], hub_env(tmp_path / "c", fake_hub), expect=2)
    assert err.startswith("ctitan: error: org/nothing: not a local directory, and the Hub"), err
    assert "HTTP 404 RepoNotFound" in err and "check the id" in err and "HF_TOKEN" in err, err
    _, err = ctitan(["import", "--hf", "org/nothing", "--out", tmp_path / "ck"], hub_env(tmp_path / "c", fake_hub),
                    expect=2)
    assert "HTTP 404 RepoNotFound" in err, err


def test_private_repo_401_and_token(tmp_path, fake_hub, models, ctitan):
    cache = tmp_path / "cache"
    _, err = ctitan(["generate", "--checkpoint", "org/private", *GEN], hub_env(cache, fake_hub), expect=2)
    assert "org/private" in err and "HTTP 401 RepoNotFound" in err and "HF_TOKEN" in err, err
    # a wrong token: said so
    _, err = ctitan(["generate", "--checkpoint", "org/private", *GEN],
                    hub_env(cache, fake_hub, HF_TOKEN="hf_wrong"), expect=2)
    assert "HTTP 401" in err and "HF_TOKEN" in err and "not accepted" in err, err
    # the right one, from HF_TOKEN and from the token file huggingface_hub reads
    out, _ = ctitan(["generate", "--checkpoint", "org/private", *GEN],
                    hub_env(cache, fake_hub, HF_TOKEN=FakeHub.TOKEN))
    assert out == hf_greedy(models["main"])
    tok_file = tmp_path / "hf_home" / "token"
    tok_file.parent.mkdir(exist_ok=True)
    tok_file.write_text(FakeHub.TOKEN + "\n")
    ctitan(["generate", "--checkpoint", "org/private", *GEN], hub_env(tmp_path / "cache2", fake_hub))
    auth = [r[3].get("Authorization") for r in fake_hub.requests("hub", "HEAD", "/org/private/")]
    assert f"Bearer {FakeHub.TOKEN}" in auth
    # never to the CDN
    assert all("Authorization" not in r[3] for r in fake_hub.requests("cdn"))
    # gated: the message says to ask for access
    _, err = ctitan(["generate", "--checkpoint", "org/gated", *GEN], hub_env(tmp_path / "g" / "c", fake_hub),
                    expect=2)
    assert "gated" in err and "GatedRepo" in err and "HF_TOKEN" in err, err


def test_offline(tmp_path, fake_hub, models, ctitan):
    cache = tmp_path / "cache"
    # nothing cached, offline: a clear error, no request
    n = len(fake_hub.log)
    _, err = ctitan(["generate", "--checkpoint", "org/tiny", *GEN], hub_env(cache, fake_hub, HF_HUB_OFFLINE="1"),
                    expect=1)
    assert "org/tiny" in err and "config.json" in err and "HF_HUB_OFFLINE" in err and "not in the" in err, err
    assert len(fake_hub.log) == n
    # cache it, then stop the server: HF_HUB_OFFLINE=1 (and TRANSFORMERS_OFFLINE=1) work from the cache
    want, _ = ctitan(["generate", "--checkpoint", "org/tiny", *GEN], hub_env(cache, fake_hub))
    fake_hub.close()
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        out, _ = ctitan(["generate", "--checkpoint", "org/tiny", *GEN], hub_env(cache, None, **{var: "1"}))
        assert out == want
    # not offline, the Hub unreachable: the cached snapshot, with a warning
    out, err = ctitan(["generate", "--checkpoint", "org/tiny", *GEN], hub_env(cache, None))
    assert out == want and "cached snapshot" in err, err
    # offline train from the cache
    data = oracle.write_bin(tmp_path / "d.bin", oracle.random_tokens(4 * 17, V, seed=5))
    sections = oracle.train_sections(tmp_path / "o", data, "org/tiny", steps=1)
    ctitan(["train", "--config", oracle.write_toml(tmp_path / "t.toml", sections)],
           hub_env(cache, None, HF_HUB_OFFLINE="1"))
    # a file the cache lacks, offline: named
    _, err = ctitan(["generate", "--checkpoint", "org/sharded", *GEN], hub_env(cache, None, HF_HUB_OFFLINE="1"),
                    expect=1)
    assert "org/sharded" in err and "HF_HUB_OFFLINE" in err, err


def test_local_dir_wins_and_non_ids(tmp_path, fake_hub, models, ctitan):
    """An existing directory named like an id is a directory; a missing path that is not
    id-shaped is a missing file (exit 1, in generate as in import) and asks nothing of the Hub."""
    local = tmp_path / "org" / "tiny"
    local.parent.mkdir()
    os.symlink(models["v2"], local)
    env = hub_env(tmp_path / "cache", fake_hub)
    p = subprocess.run([str(ROOT / os.environ.get("CTITAN_BUILD", "build") / "ctitan"), "generate", "--checkpoint",
                        "org/tiny", *GEN], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout == hf_greedy(models["v2"])
    assert not fake_hub.log, "a local directory went to the Hub"
    _, err = ctitan(["generate", "--checkpoint", tmp_path / "missing", *GEN], env, expect=1)
    assert "--checkpoint" in err and "no such directory" in err and not fake_hub.log
    _, err = ctitan(["import", "--hf", "./not/there", "--out", tmp_path / "ck"], env, expect=1)
    assert not fake_hub.log


def test_download_command_and_tokenizer_options(tmp_path, fake_hub, models, ctitan):
    cache = tmp_path / "cache"
    env = hub_env(cache, fake_hub)
    out, _ = ctitan(["download", "org/tiny"], env)
    commit = fake_hub.repos["org/tiny"].refs["main"]
    assert out.strip() == str(snapshot(cache, "org/tiny", commit))
    assert_cache_valid(cache, "org/tiny", "main", commit, {"config.json", "model.safetensors", "tokenizer.json"})
    from tokenizers import Tokenizer
    want = Tokenizer.from_file(str(models["main"] / "tokenizer.json")).encode("hello world").ids
    out, _ = ctitan(["tokenize", "--tokenizer", "org/tiny", "--text", "hello world"], env)
    assert [int(x) for x in out.split()] == want
    _, err = ctitan(["download", "not an id"], env, expect=2)
    assert "not a Hugging Face Hub model id" in err


def test_download_progress(tmp_path, fake_hub, models, ctitan_bin, ctitan):
    """core/progress.h on a download: plain lines in a pipe (every update with a 0 s period,
    the last at 100% with the time), a redrawn bar on a pseudo-terminal."""
    size = (models["main"] / "model.safetensors").stat().st_size
    env = hub_env(tmp_path / "c1", fake_hub, CTITAN_PROGRESS="plain", CTITAN_PROGRESS_PERIOD="0")
    _, err = ctitan(["download", "org/tiny"], env)
    assert "\r" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("ctitan: hub: org/tiny model.safetensors: ")]
    assert lines and re.search(r": 100\.0% [\d.]+ \S*B / [\d.]+ \S*B, [\d.]+ \S*B/s, done in [\d.]+s$", lines[-1]), err
    assert all("% " in ln and ("ETA " in ln or "done in" in ln) for ln in lines), lines
    rc, text = run_on_pty([ctitan_bin, "download", "org/tiny"], env=hub_env(tmp_path / "c2", fake_hub), cwd=ROOT,
                          timeout=180)
    assert rc == 0, text
    assert re.search(r"\rctitan: hub: org/tiny model\.safetensors \[#+\] 100\.0%.*done in [\d.]+s\x1b\[K\r?\n", text), \
        (size, text)


ENV_CASES = [
    {},
    {"XDG_CACHE_HOME": "/xdg/"},
    {"HF_HOME": "~/hfh", "XDG_CACHE_HOME": "/xdg"},
    {"HUGGINGFACE_HUB_CACHE": "/legacy", "HF_HOME": "/h"},
    {"HF_HUB_CACHE": "$HOME/c/${HOME}/$UNSET_X", "HUGGINGFACE_HUB_CACHE": "/legacy"},
    {"HF_HUB_OFFLINE": "yes", "HF_ENDPOINT": "http://mirror:8080//"},
    {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "1"},
    {"HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "True"},
    {"HF_TOKEN": "  hf_env\n", "HUGGING_FACE_HUB_TOKEN": "hf_old"},
    {"HF_TOKEN": "", "HUGGING_FACE_HUB_TOKEN": "hf_old"},
    {"HF_HOME": "{tmp}/home"},  # the token file under HF_HOME
    {"HF_TOKEN_PATH": "{tmp}/elsewhere/tok"},
    {"HF_TOKEN": "hf_env", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1"},
]

PROBE = r"""
import ctypes, json, sys
from huggingface_hub import constants
from huggingface_hub.utils import build_hf_headers
lib = ctypes.CDLL(sys.argv[1])
buf = ctypes.create_string_buffer(4096)
def s(fn):
    assert getattr(lib, fn)(buf, 4096) == 0
    return buf.value.decode()
tok = ctypes.create_string_buffer(4096)
has = lib.hub_token(tok, 4096, None)
auth = build_hf_headers().get("authorization")
print(json.dumps({"hf": [constants.HF_HUB_CACHE, constants.HF_HOME, constants.ENDPOINT, constants.HF_HUB_OFFLINE,
                         auth[len("Bearer "):] if auth else None],
                  "ctitan": [s("hub_cache_dir"), s("hub_home_dir"), s("hub_endpoint"), bool(lib.hub_offline()),
                             tok.value.decode() if has else None]}))
"""


@pytest.mark.parametrize("case", range(len(ENV_CASES)))
def test_env_rules_match_huggingface_hub(case, tmp_path, libctitan):
    """Cache directory, HF_HOME, endpoint, offline mode and token: ctitan's reading of the
    environment equals huggingface_hub's own constants and headers, case by case."""
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "token").write_text("hf_file_token\n")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "tok").write_text(" hf_other \n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGING", "XDG_")) and k != "TRANSFORMERS_OFFLINE"}
    env["HOME"] = str(tmp_path / "user")
    env["HF_HOME"] = str(tmp_path / "nothing")  # no token file of the machine's, unless the case sets HF_HOME
    env.update({k: v.replace("{tmp}", str(tmp_path)) for k, v in ENV_CASES[case].items()})
    if "HF_HOME" not in ENV_CASES[case] and ("XDG_CACHE_HOME" in ENV_CASES[case] or not ENV_CASES[case]):
        del env["HF_HOME"]  # the XDG / ~ defaults themselves
    lib = ROOT / os.environ.get("CTITAN_BUILD", "build") / "libctitan.so"
    p = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", PROBE, str(lib)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["ctitan"] == got["hf"], (ENV_CASES[case], got)


@pytest.fixture(scope="module")
def adapters(models, tmp_path_factory):
    """Two PEFT adapters (random, non-zero B) on the main model, saved by peft itself."""
    from oracle_lora import make_peft
    out = {}
    for name, seed in (("a1", 11), ("a2", 12)):
        pm = make_peft(oracle.load_hf(models["main"]), r=4, alpha=8, targets=["q_proj", "v_proj"], seed=seed)
        out[name] = tmp_path_factory.mktemp(name)
        pm.save_pretrained(str(out[name]))
    return out


def test_adapter_by_hub_id(tmp_path, fake_hub, models, adapters, ctitan):
    """generate --adapter, lora.adapter_path (and export --merge --adapter) take a PEFT adapter's Hub
    id, at --adapter-revision / lora.adapter_revision: the same result as its local directory."""
    fake_hub.add_dir("org/tiny-lora", adapters["a1"])
    v2 = fake_hub.add_dir("org/tiny-lora", adapters["a2"], branch="v2")
    cache = tmp_path / "cache"
    env = hub_env(cache, fake_hub)
    want, _ = ctitan(["generate", "--checkpoint", models["main"], "--adapter", adapters["a1"], *GEN], env)
    got, _ = ctitan(["generate", "--checkpoint", models["main"], "--adapter", "org/tiny-lora", *GEN], env)
    assert got == want
    assert_cache_valid(cache, "org/tiny-lora", "main", fake_hub.repos["org/tiny-lora"].refs["main"],
                       {"adapter_config.json", "adapter_model.safetensors"})
    # training from the v2 adapter: its step-1 loss is the local v2 adapter's, not main's
    data = oracle.write_bin(tmp_path / "d.bin", oracle.random_tokens(4 * 17, V, seed=5))
    losses = {}
    for name, src, rev in (("a1", adapters["a1"], None), ("a2", adapters["a2"], None), ("hub", "org/tiny-lora", "v2")):
        opts = {"lora.rank": 4, "lora.alpha": 8, "lora.target_modules": "q_proj,v_proj", "lora.adapter_path": str(src)}
        if rev:
            opts["lora.adapter_revision"] = rev
        sections = oracle.train_sections(tmp_path / f"o_{name}", data, models["main"], steps=1, options=opts)
        ctitan(["train", "--config", oracle.write_toml(tmp_path / f"{name}.toml", sections)], env)
        losses[name] = oracle.read_metrics(tmp_path / f"o_{name}" / "metrics.jsonl")[0]["loss"]
    assert losses["hub"] == losses["a2"] != losses["a1"], losses
    assert (cache / "models--org--tiny-lora" / "refs" / "v2").read_text() == v2
    # export --merge: the merged weights are the same bytes
    for name, ad in (("local", adapters["a1"]), ("hub", "org/tiny-lora")):
        ctitan(["export", "--checkpoint", models["main"], "--adapter", ad, "--merge", "--out", tmp_path / f"m_{name}"],
               env)
    assert (tmp_path / "m_local" / "model.safetensors").read_bytes() == \
        (tmp_path / "m_hub" / "model.safetensors").read_bytes()
    # an adapter repo the Hub does not have: the error names the option and the id
    _, err = ctitan(["generate", "--checkpoint", models["main"], "--adapter", "org/no-such-lora", *GEN], env, expect=2)
    assert "--adapter" in err and "org/no-such-lora" in err, err
    sections = oracle.train_sections(tmp_path / "o_bad", data, models["main"], steps=1,
                                     options={"lora.rank": 4, "lora.adapter_path": "org/no-such-lora"})
    _, err = ctitan(["train", "--config", oracle.write_toml(tmp_path / "bad.toml", sections)], env, expect=2)
    assert "lora.adapter_path" in err and "org/no-such-lora" in err, err
