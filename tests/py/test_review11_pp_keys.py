"""review11: torchtitan's placement keys across a resume and through config.toml.

A PP 2 run placed by module_fqns_per_model_part (given on the command line in its "a,b;c"
form, 1 layer on stage 0 and 3 on stage 1) stops at step 2; its config.toml, whose list of
lists is written as TOML arrays of arrays, is read back as --config and must place the layers
the same way and resume to the uninterrupted run's losses bit for bit; a resume placed
otherwise (pipeline_parallel_layers_per_stage: 2 and 2) is taken, as a changed split point is,
and trains the same losses (to float rounding)."""
import os
import subprocess

from conftest import BIN, crashed, tiny_run
from test_dist import losses

ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", OMP_WAIT_POLICY="passive",
           OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
FQNS = "tok_embeddings,layers.0;layers.1,layers.2,layers.3,norm,output"
PP = ["--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_microbatch_size=1",
      "--checkpoint.enable", "--checkpoint.interval=2", "--checkpoint.last_save_model_only=false"]


def mpi(args, code=0):
    from test_dist import mpirun
    cmd = mpirun() + ["-np", "2", str(BIN), *[str(a) for a in args]]
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == code, f"{' '.join(cmd)}\nexit {p.returncode}\n{p.stderr[-3000:]}"
    return p


def test_fqns_placement_round_trip_and_resume(tmp_path):
    _, ref, args = tiny_run(tmp_path, *PP, f"--parallelism.module_fqns_per_model_part={FQNS}", layers=4, steps=4,
                            out=tmp_path / "ref")
    mpi(args)
    want = losses(ref)
    assert sorted(want) == [1, 2, 3, 4]

    _, out, args = tiny_run(tmp_path, *PP, f"--parallelism.module_fqns_per_model_part={FQNS}",
                            "--training.stop_at_step=2", layers=4, steps=4, out=tmp_path / "a")
    mpi(args, code=75)
    toml = (out / "checkpoint" / "step-2" / "config.toml").read_text()
    line = [ln for ln in toml.splitlines() if ln.startswith("module_fqns_per_model_part")]
    assert line == ['module_fqns_per_model_part = [["tok_embeddings", "layers.0"], '
                    '["layers.1", "layers.2", "layers.3", "norm", "output"]]'], line
    # the saved config.toml as the run's config (the dump folder and data as saved): resumes at step 2
    cfgp = tmp_path / "saved.toml"
    cfgp.write_text(toml)
    p = mpi(["train", "--config", cfgp, "--training.stop_at_step=0"])
    assert "resuming from" in p.stderr and "step-2" in p.stderr, p.stderr[-3000:]
    got = losses(out)
    assert {s: got[s] for s in (3, 4)} == {s: want[s] for s in (3, 4)}, (got, want)

    # another placement of the same run: taken, as a changed split point is; the same losses
    _, out2, args = tiny_run(tmp_path, *PP, f"--parallelism.module_fqns_per_model_part={FQNS}",
                             "--training.stop_at_step=2", layers=4, steps=4, out=tmp_path / "b")
    mpi(args, code=75)
    _, _, args = tiny_run(tmp_path, *PP, "--parallelism.pipeline_parallel_layers_per_stage=3", layers=4, steps=4,
                          out=out2)
    p = mpi(args)
    assert "resuming from" in p.stderr and "step-2" in p.stderr, p.stderr[-3000:]
    got = losses(out2)
    for s in (3, 4):
        assert abs(got[s] - want[s]) <= 1e-5 * abs(want[s]), (s, got[s], want[s])


def test_fqns_toml_and_cli_forms_agree(tmp_path):
    """The TOML array of arrays and the command line's "a,b;c" (spaces after the separators
    allowed) give the same dry-run placement; an empty group (";;") is refused naming the key."""
    _, _, args = tiny_run(tmp_path, *PP, layers=4, steps=1)
    toml = tmp_path / "pp.toml"
    toml.write_text('[parallelism]\nmodule_fqns_per_model_part = [\n  ["tok_embeddings", "layers.0"],\n'
                    '  ["layers.1", "layers.2", "layers.3", "norm", "output"], # the last stage\n]\n')
    outs = []
    for extra in (["--config", toml], [f"--parallelism.module_fqns_per_model_part={FQNS}"],
                  ["--parallelism.module_fqns_per_model_part=tok_embeddings, layers.0; layers.1, layers.2, "
                   "layers.3, norm, output"]):
        cmd = [str(BIN), args[0], *[str(a) for a in extra], *[str(a) for a in args[1:]], "--dry-run"]
        p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
        crashed(p.returncode, p.stderr, cmd)
        assert p.returncode == 0, f"{' '.join(cmd)}\n{p.stderr[-2000:]}"
        outs.append([ln for ln in p.stdout.splitlines() if "pipeline rank" in ln])
    assert outs[0] and outs[0] == outs[1] == outs[2], outs
    cmd = [str(BIN), *[str(a) for a in args], "--dry-run",
           "--parallelism.module_fqns_per_model_part=tok_embeddings,layers.0;;layers.1,layers.2,layers.3,norm,output"]
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == 2 and "module_fqns_per_model_part" in p.stderr, p.stderr[-2000:]
