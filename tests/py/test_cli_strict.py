"""Leftovers of the second bad-input audit (stop 43, docs/reliability.md): command-line input
that was accepted with a meaning the user did not give it, and settings that did nothing in
silence. `generate --prompt-ids "1,,2"` read as `1 2`; a `kernels` subcommand took the options
of the others and ignored them (`kernels peak --op matmul`); `[lora]` keys with lora.rank = 0
and a chat template for data that is not chat changed nothing and said nothing. The first two
are refused now (exit 2 naming the argument), the last two warned about, once. Each case runs
the CLI as a user would; none needs libctitan.so, so the file runs under the sanitized build."""
import json
import re
import shutil

import pytest

import oracle
from conftest import TINY_CKPT, tiny_run
from test_data_hf import CONVERSATIONS, tokdir  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("strict")
    cfg = oracle.tiny_config(vocab=128, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8)
    oracle.save_random_hf(d / "hf", cfg, seed=3)
    return d / "hf"


# ------------------------------------------------------------------ generate --prompt-ids

def generate_ids(run_ctitan, model, ids, check=True):
    return run_ctitan(["generate", "--checkpoint", model, "--prompt-ids", ids, "--ids", "--max-tokens", "3"],
                      check=check)


@pytest.mark.parametrize("ids, pos, where", [
    ("1,,2", 3, "before"), (",1 2", 1, "before"), ("1 2,", 4, "after"), ("1, ,2", 4, "before"),
    ("  ,  ", 3, "before"), ("1,2 ,\t", 5, "after"), ("1 ,,", 4, "before"),
], ids=["double", "leading", "trailing", "spaced_double", "only_comma", "trailing_spaced", "double_at_end"])
def test_prompt_ids_comma_without_an_id(run_ctitan, model, ids, pos, where):
    """"1,,2" was read as "1 2": an id left out between the commas went unnoticed. A comma
    separates two ids, at most one between them, none before the first or after the last."""
    rc, _, err = generate_ids(run_ctitan, model, ids, check=False)
    assert rc == 2 and f'--prompt-ids: "{ids}": the comma at character {pos} has no token id {where} it' in err, \
        (rc, err)


@pytest.mark.parametrize("ids", ["+1 2", "1 2x", "1;2", "-1"])
def test_prompt_ids_not_ids(run_ctitan, model, ids):
    """An id is digits only: "+1" was read as 1 (strtol takes a sign). The other three were
    refused before too: they guard the rewritten parser."""
    rc, _, err = generate_ids(run_ctitan, model, ids, check=False)
    assert rc == 2 and f'--prompt-ids: "{ids}" is not a list of token ids' in err, (rc, err)


def test_prompt_ids_separators_still_read(run_ctitan, model):
    """Spaces, one comma, and a comma with whitespace around it all separate ids, as before
    (a guard: it passed before the fix too)."""
    want = generate_ids(run_ctitan, model, "5 9 17 3")[1]
    for ids in ["5,9,17,3", " 5, 9 ,17\t3 ", "5\n9,\n17 ,3"]:
        assert generate_ids(run_ctitan, model, ids)[1] == want, ids


def test_prompt_ids_checked_before_the_checkpoint(run_ctitan, tmp_path):
    """The ids are the command line's: refused before a checkpoint (or a Hub id) is looked at."""
    rc, _, err = run_ctitan(["generate", "--checkpoint", tmp_path / "nosuch", "--prompt-ids", "1,,2"], check=False)
    assert rc == 2 and "--prompt-ids" in err and "nosuch" not in err, (rc, err)


# ------------------------------------------------------------------ kernels SUBCOMMAND options

# each refused option beside options the subcommand reads, kept cheap: before the fix these
# ran (a one-op check or bench, the cached peak) and exited 0
NOT_THEIRS = [
    (["peak", "--op", "matmul"], "--op"), (["peak", "--threads", "1", "--quick"], "--quick"),
    (["list", "--reps", "3"], "--reps"), (["list", "--threads", "2"], "--threads"),
    (["check", "--op", "add", "--quick", "--reps", "3"], "--reps"),
    (["check", "--op", "add", "--quick", "--cold"], "--cold"),
    (["check", "--op", "add", "--quick", "--peak", "5"], "--peak"),
    (["bench", "--op", "add", "--reps", "1", "--seed", "7"], "--seed"),
    (["bench", "--op", "add", "--reps", "1", "--json"], "--json"),
    (["bench", "--op", "add", "--reps", "1", "--quick-cap", "20"], "--quick-cap"),
]


@pytest.mark.parametrize("args, bad", NOT_THEIRS, ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_kernels_refuses_options_of_other_subcommands(run_ctitan, args, bad):
    """One parser served every subcommand, so each took the options of the others and ignored
    them: `kernels peak --op matmul` printed the whole peak, not matmul's."""
    rc, out, err = run_ctitan(["kernels"] + args, check=False)
    assert rc == 2 and f"kernels {args[0]}: {bad} is not an option of this subcommand" in err, (rc, err)
    assert out == "", out  # refused before any work


@pytest.mark.parametrize("args", [
    ["list"],
    ["check", "--op", "add", "--seed", "3", "--threads", "1", "--quick"],
    ["check", "--op", "matmul", "--impl", "avx2", "--threads", "1", "--quick-cap", "20"],
    ["bench", "--op", "add", "--impl", "ref", "--threads", "1", "--reps", "1", "--quick", "--peak", "10", "--cold"],
    ["peak", "--threads", "1", "--json"],
], ids=lambda a: a[0])
def test_kernels_subcommands_take_their_options(run_ctitan, args):
    """Every option each subcommand reads (docs/benchmarks.md, the Makefile, bench/ and the
    tests use them) is still taken (a guard: it passed before the fix too)."""
    rc, out, err = run_ctitan(["kernels"] + args)
    assert out and "error" not in err, (rc, out, err)
    if args[0] == "peak":
        assert json.loads(out)["threads"] == 1


@pytest.mark.parametrize("sub, has, hasnt", [
    ("peak", ["--threads", "--json"], ["--op", "--reps", "check"]),
    ("check", ["--op", "--seed", "--quick", "--quick-cap"], ["--reps", "--json", "peak"]),
    ("list", ["list"], ["--", "bench"]),
])
def test_kernels_help_of_a_subcommand(run_ctitan, sub, has, hasnt):
    """`kernels SUB --help` lists SUB's options only (it was an unknown option, exit 2)."""
    rc, out, _ = run_ctitan(["kernels", sub, "--help"])
    assert all(h in out for h in has) and not any(h in out for h in hasnt), out


# ------------------------------------------------------------------ [lora] with rank 0

def warnings_of(err, about=""):
    """The warning lines of stderr that hold `about` (a short run also warns that its
    warmup is cut to its steps)."""
    return [ln for ln in err.splitlines() if "warning:" in ln and about in ln]


def test_lora_keys_with_rank_zero_warn(run_ctitan, tmp_path):
    """lora.alpha, dropout, target_modules, use_rslora, adapter_revision with lora.rank = 0 (the
    default: no LoRA) changed nothing, in silence. Each set one is named, with where it was set."""
    conf = tmp_path / "t.toml"
    conf.write_text('[lora]\nrank = 0\nalpha = 16\ntarget_modules = ["q_proj"]\n')
    rc, _, err = run_ctitan(["train", "--config", conf, "--lora.dropout=0.1", "--lora.use_rslora",
                             "--lora.adapter_revision=v1", "--dry-run"])
    w = warnings_of(err, "lora.")
    for src, key in [(conf, "alpha"), (conf, "target_modules"), ("command line", "dropout"),
                     ("command line", "use_rslora"), ("command line", "adapter_revision")]:
        line = f"ctitan: warning: {src}: lora.{key} has no effect: lora.rank is 0 (no LoRA)"
        assert w.count(line) == 1, (line, err)
    assert len(w) == 5, err


@pytest.mark.parametrize("args", [
    ["--lora.rank=4", "--lora.alpha=16", "--lora.dropout=0.1", "--lora.target_modules=q_proj"],
    ["--lora.alpha=8", "--lora.use_rslora=false"],  # the defaults, written out: nothing changes
    [],
], ids=["rank4", "defaults", "none"])
def test_lora_keys_that_apply_do_not_warn(run_ctitan, args):
    """A guard (silent before the fix too): LoRA on, or the defaults written out."""
    rc, _, err = run_ctitan(["train", "--dry-run"] + args)
    assert not warnings_of(err, "lora."), err


def test_lora_keys_refused_with_rank_zero_are_not_warned_about(run_ctitan, model, tmp_path):
    """lora.adapter_path (and target_parameters, rank_pattern, alpha_pattern, modules_to_save)
    with rank 0 is an error naming the key; a warning beside it would contradict it (a guard:
    no warning before the fix either)."""
    rc, _, err = run_ctitan(["train", "--model.spec=hf", f"--model.hf_assets_path={model}",
                             f"--training.dataset_path={model}/config.json", f"--job.dump_folder={tmp_path}",
                             "--lora.adapter_path=x", "--lora.adapter_revision=v1"], check=False)
    assert rc == 2 and "lora.adapter_path: needs lora.rank > 0" in err and not warnings_of(err, "lora."), (rc, err)


def test_lora_warning_once_and_not_for_the_checkpoints_config(run_ctitan, tmp_path):
    """A resume reads the checkpoint's config.toml back (to compare its trained tensors with
    the run's): that is no setting of the user's, and it lists every key. The warning comes
    once, for the command line, and a run's config.toml read back as --config does not warn
    about the defaults it lists."""
    _, out, args = tiny_run(tmp_path, *TINY_CKPT, "--lora.alpha=16", steps=4)
    rc, _, err = run_ctitan(args)
    assert warnings_of(err, "lora.") == [
        "ctitan: warning: command line: lora.alpha has no effect: lora.rank is 0 (no LoRA)"], err
    shutil.copy(out / "config.toml", tmp_path / "again.toml")
    rc, _, err = run_ctitan(args[:1] + ["--config", tmp_path / "again.toml", "--training.steps=6"])
    assert "ctitan: resuming from" in err, err  # it read the checkpoint's config.toml back
    assert warnings_of(err, "lora.") == [f"ctitan: warning: {tmp_path / 'again.toml'}: lora.alpha has no effect: "
                                "lora.rank is 0 (no LoRA)"], err


def test_validation_keys_without_enable_warn(run_ctitan, tmp_path):
    """--validation.dataset_path=val.jsonl without --validation.enable was ignored in silence.
    Like a [lora] key with rank 0, each [validation] key set with validation.enable false is
    named once, with where it was set; the defaults written out, and local_batch_size (which
    still sizes the plan), are not."""
    conf = tmp_path / "t.toml"
    conf.write_text("[validation]\nenable = false\nfreq = 5\n")
    _, _, err = run_ctitan(["train", "--config", conf, "--validation.dataset_path=val.jsonl", "--dry-run"])
    w = warnings_of(err, "validation.")
    tail = "has no effect: validation.enable is false (no validation; set --validation.enable to evaluate)"
    assert w == [f"ctitan: warning: {conf}: validation.freq {tail}",
                 f"ctitan: warning: command line: validation.dataset_path {tail}"], err
    # the defaults written out; local_batch_size sizes the model's buffers even with validation off
    _, _, err = run_ctitan(["train", "--validation.freq=100", "--validation.steps=10",
                            "--validation.local_batch_size=4", "--dry-run"])
    assert not warnings_of(err, "validation."), err


# ------------------------------------------------------------------ chat_template, not chat data

@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    d = tmp_path_factory.mktemp("texts")
    (d / "d.txt").write_text("".join(f"Line {i} of the river and the mountain.\n" for i in range(300)))
    (d / "d.jsonl").write_text("".join(json.dumps({"text": f"doc {i} of the forest"}) + "\n" for i in range(50)))
    (d / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    return d


def prepare(run_ctitan, tokdir, src, out, *extra):  # noqa: F811
    return run_ctitan(["prepare", "--tokenizer", tokdir, "--input", src, "--out", out, "--quiet"] + list(extra))


TAIL = ' (JSON Lines whose objects have "messages", "conversations" or a "prompt" list), and only chat data is rendered with a template'


@pytest.mark.parametrize("src, kind", [("d.txt", "text"), ("d.jsonl", "jsonl")])
def test_chat_template_for_data_that_is_not_chat_warns(run_ctitan, tokdir, texts, tmp_path, src, kind):  # noqa: F811
    rc, _, err = prepare(run_ctitan, tokdir, texts / src, tmp_path / "p", "--chat-template", "chatml")
    assert warnings_of(err, "chat template") == [
        f'ctitan: warning: chat template "chatml" is not applied to {texts / src}: it is {kind} data, not chat data'
        + TAIL], err


@pytest.mark.parametrize("more, after", [(["d.jsonl"], "the source after it: neither"),
                                         (["d.jsonl", "d.txt"], "the 2 sources after it: none")], ids=["2", "3"])
def test_chat_template_for_sources_none_of_them_chat(run_ctitan, tokdir, texts, tmp_path, more, after):  # noqa: F811
    inputs = [a for f in ["d.txt"] + more for a in ("--input", texts / f)]
    rc, _, err = run_ctitan(["prepare", "--tokenizer", tokdir, *inputs, "--out", tmp_path / "p", "--quiet",
                             "--chat-template", "chatml"])
    assert warnings_of(err, "chat template") == [
        f'ctitan: warning: chat template "chatml" is not applied to {texts / "d.txt"} and {after} is chat data'
        + TAIL], err


@pytest.mark.parametrize("src, extra", [("chat.jsonl", ["--chat-template", "chatml"]), ("d.txt", [])],
                         ids=["chat", "no_template"])
def test_chat_template_that_applies_does_not_warn(run_ctitan, tokdir, texts, tmp_path, src, extra):  # noqa: F811
    """A guard (silent before the fix too): chat data, or no template named."""
    rc, _, err = prepare(run_ctitan, tokdir, texts / src, tmp_path / "p", *extra)
    assert not warnings_of(err, "chat template"), err


def train_on(run_ctitan, tokdir, tmp_path, data, val):  # noqa: F811
    m = tmp_path / "m"
    if not m.exists():
        oracle.tiny_config(vocab=704, hidden=32, inter=48, layers=1, heads=4, kv_heads=2,
                           head_dim=8).save_pretrained(m)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokdir / f, m / f)
    return run_ctitan(["train", "--model.spec=hf", f"--model.hf_assets_path={m}", f"--training.dataset_path={data}",
                       "--training.chat_template=chatml", "--training.seq_len=16", "--training.local_batch_size=2",
                       "--training.steps=1", "--validation.enable", "--validation.freq=1", "--validation.steps=1",
                       f"--validation.dataset_path={val}", "--metrics.peak_tflops=1",
                       f"--job.dump_folder={tmp_path / 'out'}"])


def test_chat_template_warning_once_per_run(run_ctitan, tokdir, texts, tmp_path):  # noqa: F811
    """training.chat_template with text data for training and validation: the data is
    tokenized twice (and on every rank), the warning printed once."""
    rc, _, err = train_on(run_ctitan, tokdir, tmp_path, texts / "d.txt", texts / "d.txt")
    assert warnings_of(err, "chat template") == [
        f'ctitan: warning: chat template "chatml" is not applied to {texts / "d.txt"}: it is text data, not chat '
        'data' + TAIL], err


def test_chat_template_used_by_the_training_data_does_not_warn(run_ctitan, tokdir, texts, tmp_path):  # noqa: F811
    """Chat data to train on and text to validate on: the template is used (a guard: silent
    before the fix too)."""
    rc, _, err = train_on(run_ctitan, tokdir, tmp_path, texts / "chat.jsonl", texts / "d.txt")
    assert not warnings_of(err, "chat template"), err


@pytest.mark.parametrize("kind", ["prepared_text", "token_file"])
def test_chat_template_for_token_data_without_chat_warns(run_ctitan, tokdir, texts, tmp_path, kind):  # noqa: F811
    """Token data holds what prepare rendered: a template named for a prepared text dataset
    (meta.json records no chat) or for a plain token file shapes nothing, and said nothing.
    Validation data is the same, so the run warns once."""
    if kind == "prepared_text":
        data = tmp_path / "p"
        prepare(run_ctitan, tokdir, texts / "d.txt", data)
    else:
        data = tmp_path / "t.bin"
        oracle.write_bin(data, oracle.random_tokens(40 * 17, 704, seed=2))
    rc, _, err = train_on(run_ctitan, tokdir, tmp_path, data, data)
    assert warnings_of(err, "chat template") == [
        f'ctitan: warning: chat template "chatml" is not applied to {data}: it holds no chat data (no token is '
        'masked out of the loss), and only chat data is rendered with a template'], err


def test_chat_template_for_prepared_chat_data_does_not_warn(run_ctitan, tokdir, texts, tmp_path):  # noqa: F811
    """Prepared chat data (masked), trained with the template it was prepared with, and text
    validation data: the template has a use, so no warning (the tokenizer's pass alone, which
    never sees prepared data, warned of the validation text)."""
    data = tmp_path / "p"
    prepare(run_ctitan, tokdir, texts / "chat.jsonl", data, "--chat-template", "chatml")
    rc, _, err = train_on(run_ctitan, tokdir, tmp_path, data, texts / "d.txt")
    assert not warnings_of(err, "chat template"), err


# ------------------------------------------------------------------ a stop's checkpoint, not resumed

def test_checkpoint_a_run_will_not_resume_from_is_named(run_ctitan, tmp_path):
    """A stop saves whatever checkpoint.enable says. Rerunning the stopped command as it was
    (checkpoint.enable false, the default) started over at step 0 without a word, beside the
    checkpoint it had been told it could resume from. It still starts over (enable false
    means no resume, as in torchtitan) but says which checkpoint it leaves and how to resume."""
    _, out, args = tiny_run(tmp_path, steps=4)
    rc, _, err = run_ctitan(args + ["--training.stop_at_step=2"], check=False)
    assert rc == 75 and "--checkpoint.enable=true" in err, (rc, err)
    rc, _, err = run_ctitan(args)
    assert warnings_of(err, "resume") == [
        f"ctitan: warning: {out / 'checkpoint'} holds step-2, which this run does not resume from: "
        "checkpoint.enable is false (pass --checkpoint.enable=true to resume); starting at step 0"], err
    rc, _, err = run_ctitan(args + ["--checkpoint.enable=true", "--training.steps=6"])
    assert "ctitan: resuming from" in err and not warnings_of(err, "does not resume"), err


@pytest.mark.parametrize("final", [["--checkpoint.last_save_in_hf=true"],
                                   ["--checkpoint.enable=true"]], ids=["hf_export", "model_only"])
def test_final_saves_are_not_named_as_resumable(run_ctitan, tmp_path, final):
    """A run's final Hugging Face export and its model-only final save are named step-N
    too, but no run resumes from them: a second run beside them gets no 'does not resume'
    advice (following it led to 'nothing to do'; a review)."""
    _, out, args = tiny_run(tmp_path, steps=2)
    run_ctitan(args + final)
    assert (out / "checkpoint" / "step-2").is_dir()
    rc, _, err = run_ctitan(args)
    assert rc == 0 and not warnings_of(err, "does not resume"), err


@pytest.mark.parametrize("lora,hint,not_hint", [([], "checkpoint.initial_load_path", "lora.adapter_path"),
                                                 (["--lora.rank=4"], "lora.adapter_path", "initial_load_path")],
                         ids=["hf_export", "peft_adapter"])
def test_load_step_at_a_final_save_names_how_to_use_it(run_ctitan, tmp_path, lora, hint, not_hint):
    """checkpoint.load_step at a final save is refused with how that save can seed a run: an HF
    export through checkpoint.initial_load_path, a PEFT adapter through lora.adapter_path
    (config.c's key). The adapter was sent to initial_load_path, which takes no adapter."""
    _, out, args = tiny_run(tmp_path, "--checkpoint.last_save_in_hf=true", *lora, steps=2)
    run_ctitan(args)
    rc, _, err = run_ctitan(args + ["--checkpoint.enable=true", "--checkpoint.load_step=2", "--training.steps=4"],
                            check=False)
    assert rc == 2 and f"{out / 'checkpoint' / 'step-2'} holds a" in err, (rc, err)
    assert f"(it can seed a run: {hint}" in err and not_hint not in err, err


# ------------------------------------------------------------------ config keys and where they were set

def test_context_parallel_degree_is_read_and_checked(run_ctitan, tmp_path):
    """torchtitan's [parallelism] context_parallel_degree: 1 runs as before; 2 plans a
    context-parallel dry run (docs/distributed.md, CP); 0 is out of range; CP with tensor
    parallel names both keys; --help describes it."""
    conf = tmp_path / "cp.toml"
    conf.write_text("[parallelism]\ncontext_parallel_degree = 1\n")
    rc, _, err = run_ctitan(["train", "--config", conf, "--dry-run"], check=False)
    assert rc == 0, err
    rc, out, err = run_ctitan(["train", "--config", conf, "--parallelism.context_parallel_degree=2", "--dry-run"],
                              check=False)
    assert rc == 0 and "context_parallel 2:" in out, (rc, err)
    rc, _, err = run_ctitan(["train", "--parallelism.context_parallel_degree=0", "--dry-run"], check=False)
    assert rc == 2 and "parallelism.context_parallel_degree: must be >= 1 (got 0)" in err, (rc, err)
    # CP composes with TP (stop 48): the dry run plans 4 ranks of cp 2 x tp 2
    rc, out, err = run_ctitan(["train", "--config", conf, "--parallelism.context_parallel_degree=2",
                               "--parallelism.tensor_parallel_degree=2",
                               "--parallelism.data_parallel_shard_degree=1", "--dry-run"], check=False)
    assert rc == 0 and "context_parallel 2 x tensor_parallel 2" in out + err, (rc, out, err)
    _, out, _ = run_ctitan(["train", "--help"])
    entry = out.split("--parallelism.context_parallel_degree=", 1)[1].split("\n  --", 1)[0]
    assert "chunks of consecutive positions" in entry and "only 1 is taken" not in entry, entry


@pytest.mark.parametrize("args, origin, key", [
    (["--checkpoint.initial_load_path=/nowhere"], "command line", "checkpoint.initial_load_path:"),
    (["--validation.steps=0"], "command line", "validation.steps:"),
    (["--training.steps=-3"], "command line", "training.steps:"),
    ([], "FILE", "checkpoint.initial_load_path:"),
    (["--model.hf_assets_path="], "command line", "model.hf_assets_path: required"),
    (["--validation.dataset_path="], "command line", "validation.dataset_path: required"),
    (["--lora.modules_to_save=lm_head"], "command line", "lora.modules_to_save"),
    (["--parallelism.tensor_parallel_degree=3", "--parallelism.data_parallel_shard_degree=1"], "command line",
     "parallelism.tensor_parallel_degree = 3 does not divide"),
], ids=["cross_key_cli", "validation_steps_cli", "range_cli", "cross_key_file", "other_key_in_file",
        "val_path_cli", "after_the_parse", "layout_cli"])
def test_config_errors_name_where_the_value_was_set(run_ctitan, tmp_path, args, origin, key):
    """An error about a value set on the command line named the config file (checks run after
    the parse used the file's name for every key). A check of two keys names the command
    line when either came from it (other_key_in_file: model.spec = "hf" in the file, the
    directory emptied on the command line). range_cli (checked during the parse) and
    cross_key_file passed before too: they guard the two other origins."""
    conf = tmp_path / "c.toml"
    conf.write_text('[checkpoint]\ninitial_load_path = "/elsewhere"\n' if not args else
                    '[training]\nsteps = 2\n[model]\nspec = "hf"\nhf_assets_path = "/x"\n'
                    '[validation]\nenable = true\ndataset_path = "/v.bin"\n' if args[0].startswith(("--model", "--val"))
                    else "[training]\nsteps = 2\n")
    rc, _, err = run_ctitan(["train", "--config", conf, *args, "--dry-run"], check=False)
    where = str(conf) if origin == "FILE" else origin
    assert rc == 2 and f"ctitan: error: {where}: {key}" in err, (rc, err)


def test_help_shows_the_unset_value_beside_the_range(run_ctitan):
    """data_parallel_shard_degree read '>= 1 (default: -1)': the default outside its own range."""
    rc, out, _ = run_ctitan(["train", "--help"])
    assert "-1 (unset) or >= 1 (default: -1)" in out and ">= 1 (default: -1)" not in out.replace(
        "-1 (unset) or >= 1 (default: -1)", ""), out


@pytest.mark.parametrize("args, both", [([], False), (["x", "--flavor", "debugmodel"], True)], ids=["none", "both"])
def test_describe_says_what_is_missing(run_ctitan, args, both):
    """`ctitan describe` with nothing to describe said 'not both'."""
    rc, _, err = run_ctitan(["describe", *args], check=False)
    assert rc == 2 and "give a model directory (or Hub id) or --flavor NAME" in err and ("not both" in err) == both, \
        (rc, err)


def test_dump_folder_too_long_for_its_files(run_ctitan, tmp_path):
    """A job.dump_folder that the system takes, and whose checkpoint folder fits, but whose
    other files' paths do not (4083 of 4096 bytes: events.jsonl does not fit) trained without
    events.jsonl and wrote metrics to a cut name ('metrics.jso'); now a config error naming
    the key (a review)."""
    base = str(tmp_path / "d")
    parts, n = [], len(base)
    while n < 4083 - 201:
        parts.append("x" * 200)
        n += 201
    parts.append("y" * (4083 - n - 1))
    dump = base + "/" + "/".join(parts)
    assert len(dump) == 4083
    _, _, args = tiny_run(tmp_path, steps=1)
    rc, _, err = run_ctitan(args + [f"--job.dump_folder={dump}"], check=False)
    assert rc == 2 and "command line: job.dump_folder: too long for events.jsonl beneath it (4096 bytes, at most " \
        "4095)" in err, (rc, err[-600:])


# ------------------------------------------------------------------ torchtitan's keys ctitan has no use for

TT_BASE = '[model]\nflavor = "debugmodel"\n[training]\nseq_len = 64\nlocal_batch_size = 1\n'


def tt_dry_run(run_ctitan, tmp_path, text="", *args):
    cfg = tmp_path / "tt.toml"
    cfg.write_text(TT_BASE + text)
    return run_ctitan(["train", "--config", cfg, "--dry-run", *args], check=False)


@pytest.mark.parametrize("arg, shown, says", [
    ("--compile.enable=true", "compile.enable = true", "ctitan has no torch.compile"),
    ("--training.compile=true", "training.compile = true", "ctitan has no torch.compile"),
    ("--parallelism.enable_async_tensor_parallel=true", "parallelism.enable_async_tensor_parallel = true",
     "no asynchronous (compiled) tensor parallel"),
    ("--parallelism.expert_tensor_parallel_degree=2", "parallelism.expert_tensor_parallel_degree = 2", "so only 1 is taken"),
    ("--metrics.enable_wandb=true", "metrics.enable_wandb = true", "no Weights & Biases logger"),
    ("--model.converters=float8", 'model.converters = ["float8"]', "only [] is taken"),
    ('--model.converters=["quantize.linear.float8"]', 'model.converters = ["quantize.linear.float8"]',
     "ctitan has no model converters"),
    ("--training.mixed_precision_reduce=bfloat16", 'training.mixed_precision_reduce = "bfloat16"',
     "ctitan reduces gradients in fp32"),
    ("--checkpoint.initial_load_model_only=false", "checkpoint.initial_load_model_only = false",
     "loads Hugging Face weights only"),
    ("--model.name=llama3", 'model.name = "llama3"', 'come through model.spec = "hf"'),
    ("--quantize.linear.float8.enable_fsdp_float8_all_gather=true", "quantize.linear.float8.enable_fsdp_float8_all_gather = true",
     "ctitan has no float8 training"),
    ("--float8.emulate=true", "float8.emulate = true", "ctitan has no float8 training"),
    ("--quantize.grouped_mm.float8.fqns=experts", 'quantize.grouped_mm.float8.fqns = ["experts"]',
     "ctitan has no float8 training"),
], ids=lambda v: v if isinstance(v, str) and v.startswith("--") else None)
def test_torchtitan_key_refused_past_its_noop_value(run_ctitan, tmp_path, arg, shown, says):
    """torchtitan keys that ctitan reads only at the value that changes nothing for it (the
    pattern of context_parallel_degree): any other value is refused (exit 2), saying what ctitan
    does instead; they were all "unknown key" (or an unreadable TOML) before."""
    rc, _, err = tt_dry_run(run_ctitan, tmp_path, "", arg)
    assert rc == 2 and f"command line: {shown}" in err and says in err, err


def test_torchtitan_refusal_names_the_file(run_ctitan, tmp_path):
    """Set in the file, the refusal names the file."""
    rc, _, err = tt_dry_run(run_ctitan, tmp_path, "[compile]\nenable = true\n")
    assert rc == 2 and f"{tmp_path / 'tt.toml'}: compile.enable = true" in err, err


def test_torchtitan_keys_at_noop_values_run(run_ctitan, tmp_path):
    """The same keys at their no-op values, and the ones no value of which changes a result (timeouts,
    print_args, colors, gc_freq, AdamW implementation, float8's filter list), are read."""
    text = ('[job]\nprint_args = true\nuse_for_integration_test = true\n'
            '[metrics]\ndisable_color_printing = true\nenable_wandb = false\n'
            '[optimizer]\nimplementation = "foreach"\n'
            '[checkpoint]\nasync_mode = "disabled"\ninitial_load_model_only = true\n'
            '[parallelism]\nenable_async_tensor_parallel = false\nexpert_tensor_parallel_degree = 1\n'
            '[validation]\nseq_len = 64\n'
            '[compile]\nenable = false\ncomponents = ["model"]\n'
            '[comm]\ninit_timeout_seconds = 1800\ntrain_timeout_seconds = 600\n'
            '[quantize.linear.float8]\nfilter_fqns = ["output", "router.gate"]\n'
            '[quantize.grouped_mm.float8]\nfqns = []\n')
    cfg = tmp_path / "tt.toml"
    cfg.write_text(TT_BASE.replace('[training]\n', '[training]\ncompile = false\ngc_freq = 1\n'
                                   'mixed_precision_reduce = "float32"\n') + text)
    rc, out, err = run_ctitan(["train", "--config", cfg, "--dry-run", "--model.name=qwen3", "--model.converters=[]"],
                              check=False)
    assert rc == 0 and "dry run: model debugmodel," in out, err


def test_model_name_with_spec_hf_is_not_checked(run_ctitan, tmp_path, model):
    """With model.spec = "hf" the family comes from config.json: model.name is read, not used."""
    rc, out, err = tt_dry_run(run_ctitan, tmp_path, "", "--model.spec=hf", f"--model.hf_assets_path={model}",
                              "--model.name=llama3")
    assert rc == 0 and "dry run:" in out, err


@pytest.mark.parametrize("text, hint", [
    ("[lr_scheduler]\nlr_min = 0.1\n",
     "lr_scheduler.lr_min: unknown key (did you mean lr_scheduler.min_lr_factor? it is torchtitan's current name"),
    ("[checkpoint]\nenable_checkpoint = true\n",
     "checkpoint.enable_checkpoint: unknown key (did you mean checkpoint.enable? it is torchtitan's current name"),
    ("[checkpoint]\nlast_save_model_weights_only = true\n",
     "(did you mean checkpoint.last_save_model_only? it is torchtitan's current name for "
     "last_save_model_weights_only)"),
    # torchtitan renamed training.batch_size to local_batch_size (beside the new global_batch_size)
    ("batch_size = 8\n",  # TT_BASE ends in [training]
     "training.batch_size: unknown key (did you mean training.local_batch_size? it is torchtitan's current name"),
    ("[validation]\nenabled = true\n",
     "validation.enabled: unknown key (did you mean validation.enable? it is torchtitan's current name"),
    ("[checkpoint]\ninitial_load_model_weights_only = true\n",
     "(did you mean checkpoint.initial_load_model_only? it is torchtitan's current name for "
     "initial_load_model_weights_only)"),
], ids=["lr_min", "enable_checkpoint", "last_save_model_weights_only", "batch_size", "validation_enabled",
        "initial_load_model_weights_only"])
def test_renamed_torchtitan_keys_hint_current_name(run_ctitan, tmp_path, text, hint):
    """torchtitan's older key names got no hint (too far from the new ones to be suggested)."""
    rc, _, err = tt_dry_run(run_ctitan, tmp_path, text)
    assert rc == 2 and hint in err, err


def test_model_name_is_not_optimizer_name(run_ctitan, tmp_path):
    """model.name was refused with "did you mean optimizer.name?": it is read now, "qwen3" taken."""
    rc, out, err = tt_dry_run(run_ctitan, tmp_path, '[optimizer]\nname = "AdamW"\n', "--model.name=qwen3")
    assert rc == 0 and "optimizer.name" not in err, err


def test_dataset_not_a_kind_points_at_dataset_path(run_ctitan, tmp_path):
    """training.dataset is the kind of the files at dataset_path: a torchtitan dataset name that
    ctitan does not know says so and names dataset_path; "c4" without a path says to set it."""
    rc, _, err = tt_dry_run(run_ctitan, tmp_path, '', "--training.dataset=wikitext")
    assert rc == 2 and "'wikitext' is not one of: auto, text, jsonl, chat, tokens" in err \
        and "point training.dataset_path at local files" in err, err
    rc, _, err = tt_dry_run(run_ctitan, tmp_path, '', "--training.dataset=c4")
    assert rc == 2 and 'training.dataset = "c4"' in err and "set training.dataset_path" in err, err


def test_freeze_help_example_works_on_the_command_line(run_ctitan, tmp_path):
    """--help's example for training.freeze is a TOML array, which the command line refused (only
    a,b,c was read there): list options take a TOML array too."""
    _, help_text, _ = run_ctitan(["train", "--help"])
    example = re.search(r'e\.g\. (\[.*?\])', help_text[help_text.index("--training.freeze"):]).group(1)
    rc, out, err = tt_dry_run(run_ctitan, tmp_path, "", f"--training.freeze={example}")
    assert rc == 0 and "frozen:" in out, err


@pytest.mark.parametrize("value", ["1", "2.5", "x", "0"])
def test_kernels_check_quick_cap_takes_a_whole_number_of_2_or_more(run_ctitan, value):
    """--quick-cap N lowers --quick's caps to N rows: a value it cannot use is refused naming it."""
    rc, out, err = run_ctitan(["kernels", "check", "--op", "add", "--quick-cap", value], check=False)
    assert rc == 2 and "--quick-cap" in err and out == "", (rc, out, err)
