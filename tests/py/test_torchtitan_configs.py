"""torchtitan's own Qwen3 training configs run through `ctitan train --config F --dry-run` (a
user-journey audit found that none did). Each config below is written out as the sections, keys
and values the named pytorch/torchtitan file sets (nested tables as dotted headers, as it has
them). Only the keys that name local files are overridden (training.dataset_path: torchtitan
downloads c4, ctitan reads local files), plus a parallelism degree that a world of one rank
cannot hold. The experiment's debug_model.toml predates renames torchtitan made itself (lr_min,
enable_checkpoint, ...): it is refused with a pointer to each current name, and runs once they
are applied."""
import re

import pytest


def toml_text(sections):
    """{section: {key: value}} as TOML; a dotted section name is a nested table header."""
    def val(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v + '"'
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        return repr(v)
    return "".join(f"[{name}]\n" + "".join(f"{k} = {val(v)}\n" for k, v in kv.items()) + "\n"
                   for name, kv in sections.items())


# The sections, keys and values torchtitan's Qwen3 configs set (facts of its config format, written
# out here, not the files themselves), each named by the file that sets them.

# torchtitan/models/qwen3/train_configs/qwen3_0.6b.toml
QWEN3_0_6B = toml_text({
    "job": {"dump_folder": "./outputs", "description": "Qwen 3 0.6B training"},
    "profiling": {"enable_profiling": False, "save_traces_folder": "profile_trace", "profile_freq": 100},
    "metrics": {"log_freq": 1, "enable_tensorboard": False, "save_tb_folder": "tb"},
    "model": {"name": "qwen3", "flavor": "0.6B", "hf_assets_path": "./assets/hf/Qwen3-0.6B"},
    "optimizer": {"name": "AdamW", "lr": 3e-4, "eps": 1e-8},
    "lr_scheduler": {"warmup_steps": 2},
    "training": {"local_batch_size": 4, "seq_len": 4096, "max_norm": 1.0, "steps": 10, "dataset": "c4"},
    "parallelism": {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1,
                    "fsdp_reshard_after_forward": "default", "tensor_parallel_degree": 1,
                    "context_parallel_degree": 1},
    "checkpoint": {"enable": False, "folder": "checkpoint", "interval": 500, "last_save_model_only": False,
                   "export_dtype": "float16", "async_mode": "disabled"},
    "activation_checkpoint": {"mode": "selective", "selective_ac_option": "op"},
    "compile": {"enable": False, "components": ["model", "loss"]},
    "quantize.linear.float8": {"enable_fsdp_float8_all_gather": False,
                               "precompute_float8_dynamic_scale_for_fsdp": False, "filter_fqns": ["output"]},
})


def _moe(flavor, batch, ep):
    # torchtitan/models/qwen3/train_configs/qwen3_moe_debug.toml (flavor "debugmodel_moe", local batch 4)
    # and qwen3_30b_a3b.toml (flavor "30B-A3B", local batch 2, global 128, expert_parallel_degree 2)
    return toml_text({
        "job": {"dump_folder": "./outputs", "description": "Qwen 3 MoE debug model training"},
        "profiling": {"enable_profiling": False, "save_traces_folder": "profile_trace", "profile_freq": 100},
        "metrics": {"log_freq": 1, "enable_tensorboard": False, "save_tb_folder": "tb"},
        "model": {"name": "qwen3", "flavor": flavor, "hf_assets_path": "./tests/assets/tokenizer"},
        "optimizer": {"name": "AdamW", "lr": 3e-4, "eps": 1e-8},
        "lr_scheduler": {"warmup_steps": 2},
        "training": {**batch, "seq_len": 4096, "max_norm": 1.0, "steps": 10},
        "training.data": {"name": "c4"},
        "parallelism": {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1,
                        "fsdp_reshard_after_forward": "default", "tensor_parallel_degree": 1,
                        "enable_async_tensor_parallel": False, "expert_parallel_degree": ep,
                        "expert_tensor_parallel_degree": 1},
        "checkpoint": {"enable": False, "folder": "checkpoint", "interval": 10, "last_save_model_only": False,
                       "export_dtype": "float16", "async_mode": "disabled"},
        "activation_checkpoint": {"mode": "selective", "selective_ac_option": "op"},
        "compile": {"enable": False, "components": ["model", "loss"]},
        "quantize.linear.float8": {"enable_fsdp_float8_all_gather": False,
                                   "precompute_float8_dynamic_scale_for_fsdp": False, "filter_fqns": ["output"]},
    })


QWEN3_MOE_DEBUG = _moe("debugmodel_moe", {"local_batch_size": 4}, 1)
QWEN3_30B_A3B = _moe("30B-A3B", {"local_batch_size": 2, "global_batch_size": 128}, 2)

# torchtitan/experiments/qwen3/train_configs/debug_model.toml (its model.name is "llama3", from the
# Llama 3 debug config it started as; it predates torchtitan's own renames of lr_min and others)
EXPERIMENT_DEBUG_MODEL = toml_text({
    "job": {"dump_folder": "./outputs", "description": "Llama 3 debug training", "print_args": False,
            "use_for_integration_test": True},
    "profiling": {"enable_profiling": False, "save_traces_folder": "profile_trace", "profile_freq": 10,
                  "enable_memory_snapshot": False, "save_memory_snapshot_folder": "memory_snapshot"},
    "metrics": {"log_freq": 1, "disable_color_printing": False, "enable_tensorboard": False,
                "save_tb_folder": "tb", "enable_wandb": False},
    "model": {"name": "llama3", "flavor": "debugmodel", "tokenizer_path": "./tests/assets/tokenizer"},
    "optimizer": {"name": "AdamW", "lr": 8e-4, "eps": 1e-8},
    "lr_scheduler": {"warmup_steps": 2, "decay_ratio": 0.8, "decay_type": "linear", "lr_min": 0.0},
    "training": {"local_batch_size": 8, "seq_len": 2048, "max_norm": 1.0, "steps": 10, "compile": False,
                 "dataset": "c4_test"},
    "parallelism": {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1,
                    "fsdp_reshard_after_forward": "default", "tensor_parallel_degree": 1,
                    "enable_async_tensor_parallel": False, "pipeline_parallel_degree": 1,
                    "context_parallel_degree": 1},
    "checkpoint": {"enable_checkpoint": False, "folder": "checkpoint", "interval": 10,
                   "last_save_model_weights_only": False, "export_dtype": "float32", "async_mode": "disabled"},
    "activation_checkpoint": {"mode": "selective", "selective_ac_option": "2"},
    "float8": {"enable_fsdp_float8_all_gather": False, "precompute_float8_dynamic_scale_for_fsdp": False,
               "filter_fqns": ["output"]},
    "validation": {"enabled": False, "dataset": "c4_validation", "freq": 5, "steps": 10},
})


@pytest.fixture
def data(tmp_path):
    p = tmp_path / "c4_sample.jsonl"
    p.write_text('{"text": "a document in c4\'s layout"}\n')
    return p


def dry_run(run_ctitan, tmp_path, text, *extra, check=True):
    cfg = tmp_path / "config.toml"
    cfg.write_text(text)
    return run_ctitan(["train", "--config", cfg, "--dry-run", *extra], check=check)


@pytest.mark.parametrize("text, flavor, extra", [
    (QWEN3_0_6B, "0.6B", []),
    (QWEN3_MOE_DEBUG, "debugmodel_moe", []),
    # expert_parallel_degree = 2 needs two data-parallel ranks: the dry run has one
    (QWEN3_30B_A3B, "30B-A3B", ["--parallelism.expert_parallel_degree=1"]),
], ids=["qwen3_0.6b", "qwen3_moe_debug", "qwen3_30b_a3b"])
def test_published_qwen3_config_dry_runs(run_ctitan, tmp_path, data, text, flavor, extra):
    """Dotted tables ([quantize.linear.float8], [training.data]) parse; model.name "qwen3",
    [compile] enable = false, the float8 section that enables nothing, async_mode "disabled",
    expert_tensor_parallel_degree = 1 and enable_async_tensor_parallel = false are read;
    dataset "c4" is read as auto once training.dataset_path says where the files are."""
    _, out, err = dry_run(run_ctitan, tmp_path, text, f"--training.dataset_path={data}", *extra)
    assert f"dry run: model {flavor}," in out, (out, err)
    assert "total planned" in out


@pytest.mark.parametrize("text", [QWEN3_0_6B, QWEN3_MOE_DEBUG], ids=["dataset", "training.data.name"])
def test_c4_without_dataset_path_points_at_it(run_ctitan, tmp_path, text):
    """torchtitan downloads c4; ctitan cannot: the refusal says which key to set."""
    rc, _, err = dry_run(run_ctitan, tmp_path, text, check=False)
    assert rc == 2 and 'training.dataset = "c4"' in err and "set training.dataset_path" in err, err


def test_30b_a3b_expert_parallel_on_one_rank(run_ctitan, tmp_path, data):
    """Unchanged, the 30B-A3B config asks for expert_parallel_degree = 2 on a world of one rank:
    refused (exit 2), naming the expert parallel degree and how few data-parallel ranks there are
    (it named data_parallel_replicate_degree = 1, though the shard degree of -1 is what resolved to 1)."""
    rc, _, err = dry_run(run_ctitan, tmp_path, QWEN3_30B_A3B, f"--training.dataset_path={data}", check=False)
    assert rc == 2 and "parallelism.expert_parallel_degree = 2 needs at least 2 data-parallel ranks" in err, err
    assert "there are 1 (" in err and "data_parallel_shard_degree 1 from -1" in err, err


RENAMED = {"lr_min": "lr_scheduler.min_lr_factor", "enable_checkpoint": "checkpoint.enable",
           "last_save_model_weights_only": "checkpoint.last_save_model_only", "enabled": "validation.enable"}


def test_experiment_debug_model(run_ctitan, tmp_path, data):
    """The experiment's config holds keys torchtitan has renamed since: each is refused with its
    current name; with torchtitan's renames (and "qwen3" for the llama3 its copy says) it runs,
    its c4_test / c4_validation names, tokenizer_path, print_args, disable_color_printing,
    enable_wandb = false, training.compile = false and [float8] read as they are."""
    text = EXPERIMENT_DEBUG_MODEL
    for old, new in RENAMED.items():
        rc, _, err = dry_run(run_ctitan, tmp_path, text, f"--training.dataset_path={data}", check=False)
        assert rc == 2 and f"did you mean {new}? it is torchtitan's current name for {old}" in err, err
        text = re.sub(rf"^{old} =", f"{new.split('.')[1]} =", text, flags=re.M)
    rc, _, err = dry_run(run_ctitan, tmp_path, text, f"--training.dataset_path={data}", check=False)
    assert rc == 2 and 'model.name = "llama3"' in err and 'model.spec = "hf"' in err, err
    text = text.replace('name = "llama3"', 'name = "qwen3"')
    _, out, _ = dry_run(run_ctitan, tmp_path, text, f"--training.dataset_path={data}")
    assert "dry run: model debugmodel," in out
