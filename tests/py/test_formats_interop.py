"""Interop of ctitan's safetensors and .npy code with the reference Python libraries.

Files written by `safetensors` / `numpy.save` must read back in C with the same
bytes; files written by ctitan's writer must load in `safetensors` (torch backend,
for bf16) with the values torch itself produces when converting the same fp32
numbers. The C side is a small helper program compiled here with gcc from the
format sources only, so this test needs neither build/ nor the rest of ctitan.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

HELPER_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "formats/npy.h"
#include "formats/safetensors.h"

static void dump_tensor(const st_tensor *t, const char *file) {
    printf("T %s %s %s %d", file ? file : "-", t->name, ct_dtype_name(t->dtype), t->ndim);
    for (int k = 0; k < t->ndim; k++) printf(" %lld", (long long)t->shape[k]);
    printf(" ");
    const unsigned char *b = t->data;
    for (size_t i = 0; i < t->nbytes; i++) printf("%02x", b[i]);
    printf("\n");
}

/* fp32 test values, also computed by the Python side */
static float val(int i) { return (float)i * 0.37f - 5.0f + (float)(i % 7) * 1e-3f; }

int main(int argc, char **argv) {
    ct_err e = {0};
    if (argc == 3 && strcmp(argv[1], "dump") == 0) {
        st_file *f = st_open(argv[2], &e);
        if (!f) { fprintf(stderr, "%s\n", e.msg); return 1; }
        const char *fmt = st_metadata(f, "format");
        printf("M format %s\n", fmt ? fmt : "-");
        for (int i = 0; i < st_count(f); i++) dump_tensor(st_get(f, i), NULL);
        st_close(f);
        return 0;
    }
    if (argc == 3 && strcmp(argv[1], "dumpset") == 0) {
        st_set *s = st_set_open(argv[2], &e);
        if (!s) { fprintf(stderr, "%s\n", e.msg); return 1; }
        for (int i = 0; i < st_set_count(s); i++) {
            const char *file = NULL;
            const st_tensor *t = st_set_find(s, st_set_get(s, i)->name, &file);
            const char *base = strrchr(file, '/');
            dump_tensor(t, base ? base + 1 : file);
        }
        st_set_close(s);
        return 0;
    }
    if (argc == 4 && (strcmp(argv[1], "write") == 0 || strcmp(argv[1], "writedir") == 0)) {
        enum { N = 1000 };
        static float x[N];
        for (int i = 0; i < N; i++) x[i] = val(i);
        x[3] = 1.00390625f; x[4] = 1.01171875f; x[5] = 65504.0f; x[6] = 1e-8f; x[7] = -0.0f;
        int64_t iv[3] = {-1, 0, 5000000000LL};
        unsigned char u8[4] = {0, 1, 128, 255};
        float scalar = 2.5f;
        st_wtensor ts[] = {
            {"model.embed_tokens.weight", CT_BF16, CT_F32, 2, {25, 40}, x},
            {"f32", CT_F32, CT_F32, 2, {10, 10}, x},
            {"f16", CT_F16, CT_F32, 1, {1000}, x},
            {"i64", CT_I64, CT_I64, 1, {3}, iv},
            {"u8", CT_U8, CT_U8, 2, {2, 2}, u8},
            {"scalar", CT_F32, CT_F32, 0, {0}, &scalar},
            {"empty", CT_F32, CT_F32, 2, {0, 3}, NULL},
        };
        const char *meta[] = {"format", "pt", NULL};
        int rc = strcmp(argv[1], "write") == 0
                     ? st_write(argv[2], ts, 7, meta, &e)
                     : st_write_dir(argv[2], ts, 7, (size_t)atol(argv[3]), meta, &e);
        if (rc) { fprintf(stderr, "%s\n", e.msg); return 1; }
        return 0;
    }
    if (argc == 4 && strcmp(argv[1], "tof32") == 0) {
        /* the file's first tensor converted to fp32 by ct_convert_to_f32 (the loaders'
         * conversion), raw little-endian floats written to argv[3] */
        st_file *f = st_open(argv[2], &e);
        if (!f) { fprintf(stderr, "%s\n", e.msg); return 1; }
        const st_tensor *t = st_get(f, 0);
        size_t n = t->nbytes / ct_dtype_size(t->dtype);
        float *y = malloc((n + 1) * sizeof *y);
        if (ct_convert_to_f32(y, t->data, t->dtype, n)) { fprintf(stderr, "not a float type\n"); return 1; }
        FILE *o = fopen(argv[3], "wb");
        if (!o || fwrite(y, sizeof *y, n, o) != n || fclose(o)) { fprintf(stderr, "write failed\n"); return 1; }
        free(y);
        st_close(f);
        return 0;
    }
    if (argc == 4 && strcmp(argv[1], "writef16") == 0) {
        /* raw fp32 values from argv[2] written by st_write as one F16 tensor "x" */
        FILE *in = fopen(argv[2], "rb");
        if (!in) { fprintf(stderr, "open failed\n"); return 1; }
        fseek(in, 0, SEEK_END);
        long nb = ftell(in);
        fseek(in, 0, SEEK_SET);
        size_t n = (size_t)nb / 4;
        float *x = malloc((n + 1) * sizeof *x);
        if (fread(x, 4, n, in) != n) { fprintf(stderr, "read failed\n"); return 1; }
        fclose(in);
        st_wtensor ts[] = {{"x", CT_F16, CT_F32, 1, {(int64_t)n}, x}};
        if (st_write(argv[3], ts, 1, NULL, &e)) { fprintf(stderr, "%s\n", e.msg); return 1; }
        free(x);
        return 0;
    }
    if (argc == 3 && strcmp(argv[1], "npy") == 0) {
        uint32_t *v; size_t n;
        if (npy_read_u32(argv[2], &v, &n, &e)) { fprintf(stderr, "%s\n", e.msg); return 1; }
        printf("%zu", n);
        for (size_t i = 0; i < n; i++) printf(" %u", v[i]);
        printf("\n");
        free(v);
        return 0;
    }
    fprintf(stderr, "usage\n");
    return 2;
}
"""


def c_values(n: int = 1000) -> np.ndarray:
    """The helper's val(i), computed in fp32 exactly as C does it."""
    i = np.arange(n, dtype=np.float32)
    x = i * np.float32(0.37) - np.float32(5.0) + (np.arange(n) % 7).astype(np.float32) * np.float32(1e-3)
    x = x.astype(np.float32)
    x[3], x[4], x[5], x[6], x[7] = 1.00390625, 1.01171875, 65504.0, 1e-8, -0.0
    return x


@pytest.fixture(scope="module")
def helper(tmp_path_factory) -> Path:
    gcc = shutil.which("gcc")
    assert gcc, "gcc is needed to build the interop helper"
    d = tmp_path_factory.mktemp("helper")
    src = d / "helper.c"
    src.write_text(HELPER_C)
    exe = d / "helper"
    srcs = [ROOT / "src/core/err.c", ROOT / "src/core/dtype.c", ROOT / "src/core/fs.c",
            *(ROOT / f"src/formats/{f}.c" for f in ("st_read", "st_write", "st_index")), ROOT / "src/formats/npy.c",
            ROOT / "src/formats/json.c"]
    cmd = [gcc, "-std=c11", "-O1", "-g", "-D_GNU_SOURCE", f"-I{ROOT / 'src'}", str(src), *map(str, srcs),
           "-o", str(exe), "-lcjson", "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return exe


def run(helper: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([str(helper), *map(str, args)], capture_output=True, text=True, timeout=60)
    if ok:
        assert r.returncode == 0, r.stderr
    return r


def parse_dump(out: str):
    meta, tensors = {}, {}
    for line in out.splitlines():
        parts = line.split(" ")
        if parts[0] == "M":
            meta[parts[1]] = parts[2]
        elif parts[0] == "T":
            file, name, dtype, ndim = parts[1], parts[2], parts[3], int(parts[4])
            shape = tuple(int(s) for s in parts[5:5 + ndim])
            data = bytes.fromhex(parts[5 + ndim]) if len(parts) > 5 + ndim else b""
            tensors[name] = (dtype, shape, data, file)
    return meta, tensors


NP_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "U64": np.uint64,
             "I32": np.int32, "U32": np.uint32, "I16": np.int16, "U16": np.uint16, "I8": np.int8,
             "U8": np.uint8, "BOOL": np.bool_}


def test_reads_files_written_by_safetensors(helper, tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    arrays = {
        "a.f32": rng.standard_normal((3, 5)).astype(np.float32),
        "b.f16": rng.standard_normal((7,)).astype(np.float16),
        "c.f64": rng.standard_normal((2, 2, 2)).astype(np.float64),
        "d.i64": np.array([-(2**40), 0, 2**62], dtype=np.int64),
        "e.i32": np.array([[1, -2], [3, -4]], dtype=np.int32),
        "f.u16": np.array([0, 65535], dtype=np.uint16),
        "g.i8": np.array([-128, 127, 0], dtype=np.int8),
        "h.u8": np.arange(11, dtype=np.uint8),
        "i.bool": np.array([True, False, True]),
        "j.scalar": np.array(1.5, dtype=np.float32),
        "k.empty": np.zeros((0, 4), dtype=np.float32),
        "l.u32": np.array([4294967295], dtype=np.uint32),
    }
    path = tmp_path / "np.safetensors"
    save_file(arrays, str(path), metadata={"format": "np"})
    meta, got = parse_dump(run(helper, "dump", path).stdout)
    assert meta == {"format": "np"}
    assert set(got) == set(arrays)
    for name, arr in arrays.items():
        dtype, shape, data, _ = got[name]
        assert NP_DTYPES[dtype] == arr.dtype.type, name
        assert shape == arr.shape, name
        assert data == np.ascontiguousarray(arr).tobytes(), name


def test_reads_bf16_written_by_torch(helper, tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    t = torch.linspace(-3, 3, 17, dtype=torch.float32).to(torch.bfloat16).reshape(1, 17)
    path = tmp_path / "t.safetensors"
    save_file({"w": t, "v": torch.arange(4, dtype=torch.int32)}, str(path), metadata={"format": "pt"})
    meta, got = parse_dump(run(helper, "dump", path).stdout)
    assert meta["format"] == "pt"
    dtype, shape, data, _ = got["w"]
    assert (dtype, shape) == ("BF16", (1, 17))
    assert data == t.view(torch.int16).numpy().tobytes()
    assert got["v"][2] == np.arange(4, dtype=np.int32).tobytes()


def check_written(tensors: dict, torch):
    """Compares what safetensors loaded from ctitan's writer with torch's own conversions."""
    x = torch.from_numpy(c_values())
    assert torch.equal(tensors["f32"], x[:100].reshape(10, 10))
    bf = tensors["model.embed_tokens.weight"]
    assert bf.dtype == torch.bfloat16 and bf.shape == (25, 40)
    assert torch.equal(bf.view(torch.int16), x.to(torch.bfloat16).reshape(25, 40).view(torch.int16))
    f16 = tensors["f16"]
    assert f16.dtype == torch.float16
    assert torch.equal(f16.view(torch.int16), x.to(torch.float16).view(torch.int16))
    assert tensors["i64"].tolist() == [-1, 0, 5000000000]
    assert tensors["u8"].tolist() == [[0, 1], [128, 255]]
    assert tensors["scalar"].shape == () and tensors["scalar"].item() == 2.5
    assert tensors["empty"].shape == (0, 3)


def test_writer_output_loads_in_safetensors(helper, tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = tmp_path / "c.safetensors"
    run(helper, "write", path, 0)
    check_written(load_file(str(path)), torch)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert list(f.keys()) == sorted(["model.embed_tokens.weight", "f32", "f16", "i64", "u8", "scalar",
                                         "empty"])


def test_sharded_writer_output_loads(helper, tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    d = tmp_path / "model"
    run(helper, "writedir", d, 1000)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert not (d / "model.safetensors").exists()
    wm = index["weight_map"]
    shards = sorted(set(wm.values()))
    assert len(shards) > 1
    assert all(s.startswith("model-") and s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    merged, total = {}, 0
    for s in shards:
        part = load_file(str(d / s))
        for k, v in part.items():
            assert wm[k] == s and k not in merged
            merged[k] = v
            total += v.numel() * v.element_size()
    assert set(merged) == set(wm)
    assert index["metadata"]["total_size"] == total
    check_written(merged, torch)
    # and the C reader opens the same directory, finding each tensor in its shard
    _, got = parse_dump(run(helper, "dumpset", d).stdout)
    assert {k: v[3] for k, v in got.items()} == wm


def test_reads_npy_written_by_numpy(helper, tmp_path):
    cases = {
        "i4": np.array([0, 1, 151645, 2**31 - 1], dtype="<i4"),
        "u4": np.array([[4294967295, 7], [8, 9]], dtype="<u4"),
        "i8": np.array([3, 2**32 - 1], dtype="<i8"),
        "u8": np.array([1, 2, 3], dtype="<u8"),
        "i2": np.arange(5, dtype="<i2").reshape(5, 1),
        "u2": np.array([65535], dtype="<u2"),
        "u1": np.arange(256, dtype=np.uint8),
        "i1": np.array([5, 127], dtype=np.int8),
        "scalar": np.array(42, dtype=np.int32),
        "empty": np.zeros((0,), dtype=np.int32),
        "nonc": np.arange(12, dtype=np.int32).reshape(3, 4).T,  # saved C-ordered transposed copy
    }
    for name, arr in cases.items():
        p = tmp_path / f"{name}.npy"
        np.save(p, np.ascontiguousarray(arr))
        out = run(helper, "npy", p).stdout.split()
        assert int(out[0]) == arr.size, name
        assert [int(v) for v in out[1:]] == np.ascontiguousarray(arr).ravel().astype(np.int64).tolist(), name
    # format versions 2.0 and 3.0
    for ver in [(2, 0), (3, 0)]:
        p = tmp_path / f"v{ver[0]}.npy"
        with open(p, "wb") as fp:
            np.lib.format.write_array(fp, np.array([9, 8, 7], dtype=np.uint16), version=ver)
        assert run(helper, "npy", p).stdout.split() == ["3", "9", "8", "7"]


@pytest.mark.parametrize("arr,needle", [
    (np.array([1, 2], dtype=">i4"), "big-endian"),
    (np.array([1.0, 2.0], dtype=np.float32), "not an integer"),
    (np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3)), "fortran"),
    (np.array([1, -1], dtype=np.int64), "element 1 is -1"),
    (np.array([2**32], dtype=np.uint64), "element 0 is 4294967296"),
])
def test_npy_rejections(helper, tmp_path, arr, needle):
    p = tmp_path / "bad.npy"
    np.save(p, arr)
    r = run(helper, "npy", p, ok=False)
    assert r.returncode == 1
    assert str(p) in r.stderr and needle in r.stderr, r.stderr


def test_f16_read_every_bit_pattern_as_numpy(helper, tmp_path):
    """Every finite f16 bit pattern (subnormals, zeros of both signs, normals up to 65504),
    written by safetensors.numpy and converted to fp32 by ctitan's loader conversion, is
    bit for bit numpy's float16 -> float32 (exact: every f16 value is an f32 value)."""
    from safetensors.numpy import save_file

    bits = np.arange(65536, dtype=np.uint16)
    h = bits.view(np.float16)
    h = h[np.isfinite(h)]
    assert h.size == 65536 - 2 * 1024  # 2 infs and 2046 NaNs left out
    path = tmp_path / "all_f16.safetensors"
    save_file({"x": h}, str(path))
    out = tmp_path / "y.f32"
    run(helper, "tof32", path, out)
    got = np.fromfile(out, dtype=np.float32)
    want = h.astype(np.float32)
    assert got.shape == want.shape
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, (f"{bad.size} f16 patterns differ, first: f16 bits 0x{int(h.view(np.uint16)[bad[0]]):04x} "
                           f"-> {got[bad[0]]!r}, numpy {want[bad[0]]!r}")


def test_f16_write_rounds_as_numpy(helper, tmp_path):
    """ctitan's F16 writer rounds fp32 to nearest even as numpy's astype(float16) does, in
    the subnormal range (the ties k * 2^-25, k odd: half an f16 subnormal ulp) as for the
    normals (exact ties of the 13 dropped mantissa bits, both parities), overflow and
    random values across the whole range."""
    from safetensors.numpy import load_file

    rng = np.random.default_rng(7)
    k = np.arange(1, 2 * 2048, 2, dtype=np.float64)  # k * 2^-25 < 2^-13: subnormal ties and the
    sub_ties = (k * 2.0 ** -25).astype(np.float32)  # ties around the smallest normal
    near_ties = np.concatenate([np.nextafter(sub_ties, np.float32(0)), np.nextafter(sub_ties, np.float32(1))])
    # normal ties: an f16 normal's bits widened to f32, plus exactly half an f16 ulp (bit 12)
    hb = rng.integers(0x0400, 0x7bff, size=4000, dtype=np.uint16).view(np.float16).astype(np.float32)
    norm_ties = (hb.view(np.uint32) | np.uint32(0x1000)).view(np.float32)
    rand = np.concatenate([
        rng.standard_normal(4000).astype(np.float32) * np.float32(10.0) ** rng.integers(-9, 5, 4000),
        rng.uniform(-70000, 70000, 1000).astype(np.float32),
        np.array([0.0, -0.0, 65504.0, 65519.996, 65520.0, 1e-8, 2.0 ** -25, 2.0 ** -24, 2.0 ** -14], np.float32),
    ])
    x = np.concatenate([sub_ties, -sub_ties, near_ties, norm_ties, -norm_ties, rand]).astype(np.float32)
    raw = tmp_path / "x.f32"
    x.tofile(raw)
    path = tmp_path / "f16.safetensors"
    run(helper, "writef16", raw, path)
    got = load_file(str(path))["x"]
    assert got.dtype == np.float16 and got.shape == x.shape
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    bad = np.flatnonzero(got.view(np.uint16) != want.view(np.uint16))
    assert bad.size == 0, (f"{bad.size} values differ, first: {x[bad[0]]!r} -> 0x{int(got.view(np.uint16)[bad[0]]):04x}, "
                           f"numpy 0x{int(want.view(np.uint16)[bad[0]]):04x}")


def st_layout(path: Path):
    """(header length, {name: (dtype, begin)}) of a safetensors file, read with struct/json."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8:8 + n])
    head.pop("__metadata__", None)
    return n, {k: (v["dtype"], v["data_offsets"][0]) for k, v in head.items()}


ST_SIZES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2, "I16": 2, "U16": 2,
            "I8": 1, "U8": 1, "BOOL": 1}


@pytest.mark.parametrize("mode", ["write", "writedir"])
def test_written_files_are_aligned_as_safetensors_writes_them(helper, tmp_path, mode):
    """safetensors' save_file pads the JSON header with spaces to a multiple of 8 bytes and
    stores the data largest element size first, so every tensor starts (in the file and in
    a mapping of it) at a multiple of its element size; ctitan's files (one file and
    shards) must be laid out alike, the reference file showing the rule holds there too."""
    from safetensors.numpy import save_file

    ref = tmp_path / "ref.safetensors"
    save_file({"a": np.zeros(3, np.uint8), "b": np.zeros(5, np.float16), "c": np.zeros(1, np.int64)}, str(ref))
    files = [ref]
    if mode == "write":
        files.append(tmp_path / "c.safetensors")
        run(helper, "write", files[-1], 0)
    else:
        d = tmp_path / "model"
        run(helper, "writedir", d, 1000)
        shards = sorted(d.glob("model-*.safetensors"))
        assert len(shards) > 1
        files += shards
    for f in files:
        n, layout = st_layout(f)
        assert (8 + n) % 8 == 0, f"{f.name}: header of {n} bytes leaves the data at offset {8 + n}, not 8-aligned"
        for name, (dtype, begin) in layout.items():
            assert (8 + n + begin) % ST_SIZES[dtype] == 0, f"{f.name}: {name} ({dtype}) begins at {8 + n + begin}"
