"""Recipes load and validate; every validation rule fires on a crafted bad config and names its field."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config import ConfigError, collect_problems, dp_size, load_config, validate_config
from megarl.config.loader import field_help

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
DEFAULT = ROOT / "recipes" / "smollm2-135m-grpo-cpu.yaml"


def problems_for(overrides: list[str], recipe: Path = DEFAULT) -> list[str]:
    cfg = load_config(recipe, overrides, validate=False)
    return collect_problems(cfg)


def assert_one_problem(overrides: list[str], field: str, *fragments: str, recipe: Path = DEFAULT) -> None:
    found = [p for p in problems_for(overrides, recipe) if p.startswith(field + ":")]
    assert found, f"no problem for {field}; got {problems_for(overrides, recipe)}"
    for fragment in fragments:
        assert any(fragment in p for p in found), (fragment, found)


def test_recipes_exist_and_cover_the_model_sizes():
    names = {p.stem for p in RECIPES}
    assert {"smollm2-135m-grpo-cpu", "qwen2.5-0.5b-grpo", "llama3.1-8b-ppo", "qwen3-8b-dapo",
            "qwen3-30b-a3b-grpo", "qwen3-235b-a22b-dapo", "deepseek-v3-671b-grpo"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_loads_and_validates(recipe):
    cfg = load_config(recipe)
    assert cfg.name == recipe.stem
    for role in cfg.megatron_roles:
        assert dp_size(getattr(cfg, role)) >= 1


def test_every_field_has_help_and_default():
    rows = field_help()
    assert len(rows) > 100
    missing = [name for name, _, help_text, _ in rows if not help_text]
    assert not missing, missing


def test_unknown_key_suggests_closest_name():
    with pytest.raises(ConfigError) as err:
        load_config(DEFAULT, ["actor.optim.lrr=1e-5"])
    assert "actor.optim.lrr: unknown key (did you mean 'actor.optim.lr'?)" in err.value.problems


def test_unknown_section_key_from_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  n_per_promt: 4\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert any(p.startswith("rollout.n_per_promt: unknown key") and "rollout.n_per_prompt" in p
               for p in err.value.problems)


def test_overrides_apply_and_are_type_checked():
    cfg = load_config(DEFAULT, ["actor.optim.lr=3e-5", "rollout.sampling.stop_token_ids=[1,2]",
                                "algorithm.dual_clip_c=3", "trainer.total_steps=7"])
    assert cfg.actor.optim.lr == pytest.approx(3e-5)
    assert cfg.rollout.sampling.stop_token_ids == [1, 2]
    assert cfg.algorithm.dual_clip_c == 3.0 and isinstance(cfg.algorithm.dual_clip_c, float)
    assert cfg.trainer.total_steps == 7
    with pytest.raises(ConfigError) as err:
        load_config(DEFAULT, ["trainer.total_steps=many", "actor.enabled=3", "rollout.sampling.stop_token_ids=[a]"])
    problems = "\n".join(err.value.problems)
    assert "trainer.total_steps: expected an integer, got str 'many'" in problems
    assert "actor.enabled: expected true/false" in problems
    assert "rollout.sampling.stop_token_ids[0]: expected an integer" in problems


def test_literal_choice_error_suggests():
    with pytest.raises(ConfigError) as err:
        load_config(DEFAULT, ["algorithm.advantage=grp"])
    assert any(p.startswith("algorithm.advantage: 'grp' is not one of") and "did you mean 'grpo'" in p
               for p in err.value.problems)


def test_malformed_override():
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        load_config(DEFAULT, ["actor.optim.lr"])


@pytest.mark.parametrize("overrides,field,fragments", [
    (["actor.gpus=3", "actor.parallel.tp=2"], "actor.gpus", ["not divisible by tp*pp*cp"]),
    (["actor.gpus=2", "actor.parallel.tp=2"], "actor.parallel.tp", ["does not divide num_attention_heads = 9"]),
    (["actor.gpus=4", "actor.parallel.pp=4"], "actor.parallel.pp", ["num_layers = 30", "does not split evenly"]),
    (["actor.parallel.ep=2", "actor.gpus=2"], "actor.parallel.ep", ["model has no experts"]),
    (["rollout.n_per_prompt=1"], "rollout.n_per_prompt", ["needs n_per_prompt >= 2"]),
    (["batch.global_batch_size=12"], "batch.global_batch_size", ["does not divide samples per step"]),
    (["batch.global_batch_size=2", "actor.micro_batch_size=4", "actor.packing=false"], "batch.global_batch_size",
     ["micro_batch_size*dp"]),
    (["algorithm.clip_low=1.5"], "algorithm.clip_low", ["must be in (0, 1)"]),
    (["algorithm.dual_clip_c=0.5"], "algorithm.dual_clip_c", ["must be > 1"]),
    (["algorithm.old_logprobs=rollout", "algorithm.tis_cap=2"], "algorithm.tis_cap", ["old_logprobs = 'rollout'"]),
    (["algorithm.kl.mode=loss"], "ref.enabled", ["needs the reference model"]),
    (["algorithm.advantage=gae"], "critic.enabled", ["needs a critic"]),
    (["critic.enabled=true"], "critic.enabled", ["does not use values"]),
    (["rollout.sampling.top_p=0"], "rollout.sampling.top_p", ["(0, 1]"]),
    (["rollout.sampling.temperature=-1"], "rollout.sampling.temperature", [">= 0"]),
    (["actor.optim.lr=0"], "actor.optim.lr", ["must be > 0"]),
    (["data.source=jsonl"], "data.path", ["needs a file path"]),
    (["reward.kind=function"], "reward.function", ["needs module:function"]),
    (["reward.kind=model"], "reward_model.enabled", ["needs the reward model role"]),
    (["sync.bucket_mb=0"], "sync.bucket_mb", [">= 1"]),
    (["sync.transport=nccl"], "sync.transport", ["cuda"]),
    (["actor.parallel.sequence_parallel=true"], "actor.parallel.sequence_parallel", ["needs tp >= 2"]),
    (["algorithm.overlong.enabled=true", "algorithm.overlong.buffer_len=100"], "algorithm.overlong.buffer_len", ["max_new_tokens = 40"]),
    (["actor.parallel.vpp=2"], "actor.parallel.vpp", ["needs pp >= 2"]),
    (["actor.gpus=2", "actor.parallel.pp=2", "actor.parallel.vpp=3"], "actor.parallel.vpp",
     ["training needs cluster.device=cuda", "vpp=1 on CPU"]),
    (["actor.gpus=2", "actor.parallel.pp=2", "actor.parallel.first_stage_layers=31"], "actor.parallel.pp",
     ["first_stage_layers 31 = -1 layers"]),
    (["cluster.backend=local", "actor.gpus=3", "actor.parallel.tp=3"], "cluster.backend",
     ["local runs one rank per role, actor.gpus = 3", "cluster.backend=ray"]),
    (["cluster.device=cuda"], "cluster.gpus_per_node", ["gpus_per_node is 0"]),
    (["trainer.total_steps=0"], "trainer.total_steps", [">= 1"]),
    (["logging.profile_steps=[0]"], "logging.profile_steps", ["counted from 1"]),
    (["logging.profile_phases=[trian]"], "logging.profile_phases", ["'trian'", "train"]),
])
def test_validation_rule_names_field(overrides, field, fragments):
    assert_one_problem(overrides, field, *fragments)


def test_kv_heads_vs_tp_and_experts_vs_ep():
    moe = DEFAULT.parent / "qwen3-30b-a3b-grpo.yaml"
    assert_one_problem(["actor.parallel.tp=8", "actor.parallel.pp=1", "actor.parallel.ep=1", "ref.parallel.tp=8",
                        "ref.parallel.pp=1", "ref.parallel.ep=1"], "actor.parallel.tp", "num_kv_heads = 4", recipe=moe)
    assert_one_problem(["actor.parallel.ep=3", "actor.gpus=24", "ref.gpus=24", "rollout.gpus=24", "rollout.num_servers=6",
                        "cluster.nodes=3"], "actor.parallel.ep", "does not divide num_experts = 128", recipe=moe)


def test_colocated_pools_must_be_equal_and_fit():
    moe = DEFAULT.parent / "qwen3-30b-a3b-grpo.yaml"
    assert_one_problem(["ref.gpus=8"], "ref.gpus", "colocated pools must be equal", recipe=moe)
    assert_one_problem(["rollout.gpus=8", "rollout.num_servers=2"], "rollout.gpus", "colocated pools must be equal", recipe=moe)
    assert_one_problem(["cluster.nodes=1"], "actor.gpus", "the cluster has nodes*gpus_per_node = 8", recipe=moe)


def test_disaggregated_pools_must_fit():
    ds = DEFAULT.parent / "deepseek-v3-671b-grpo.yaml"
    assert_one_problem(["cluster.nodes=16"], "rollout.gpus", "need actor + critic + rollout = 192", recipe=ds)
    assert_one_problem(["rollout.num_servers=8"], "rollout.num_servers", "rollout.gpus/rollout.tp = 4", recipe=ds)


def test_uneven_pipeline_split():
    ds = DEFAULT.parent / "deepseek-v3-671b-grpo.yaml"
    assert_one_problem(["actor.parallel.last_stage_layers=12"], "actor.parallel.pp", "49 layers do not split evenly", recipe=ds)


def test_arch_read_from_config_json_and_checked(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "tie_word_embeddings": False}))
    cfg = load_config(DEFAULT, [f"model.hf_path={tmp_path}", "model.arch.num_layers=0", "model.arch.hidden_size=0",
                                "model.arch.ffn_hidden_size=0", "model.arch.num_attention_heads=0",
                                "model.arch.num_kv_heads=0", "model.arch.vocab_size=0", "model.arch.tie_word_embeddings=false"])
    assert (cfg.model.arch.num_layers, cfg.model.arch.num_kv_heads) == (4, 2)
    # the recipe's arch (SmolLM2's 30 layers) disagrees with this config.json
    assert_one_problem([f"model.hf_path={tmp_path}"], "model.arch.num_layers", "recipe says 30")
    # tp=4 on 2 kv heads is caught through config.json's numbers
    cfg = load_config(DEFAULT, [f"model.hf_path={tmp_path}", "model.arch.num_layers=0", "model.arch.hidden_size=0",
                                "model.arch.ffn_hidden_size=0", "model.arch.num_attention_heads=0",
                                "model.arch.num_kv_heads=0", "model.arch.vocab_size=0",
                                "model.arch.tie_word_embeddings=false", "actor.gpus=4", "actor.parallel.tp=4",
                                "batch.global_batch_size=16"], validate=False)
    assert any(p.startswith("actor.parallel.tp:") and "num_kv_heads = 2" in p for p in collect_problems(cfg))


def test_paths_checked_at_launch_only(tmp_path):
    cfg = load_config(DEFAULT.parent / "qwen3-8b-dapo.yaml")  # validates without the data on disk
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, check_paths=True)
    assert any(p.startswith("data.path: 'data/dapo-math-17k/train.jsonl' does not exist") for p in err.value.problems)
    assert any(p.startswith("model.hf_path: no config.json") for p in err.value.problems)


def test_missing_recipe_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: [1, 2\n")
    with pytest.raises(ConfigError, match="YAML error"):
        load_config(bad)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megarl", *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_cli_help_and_config():
    out = run_cli("--help")
    assert out.returncode == 0
    for command in ("train", "config", "convert", "plan", "serve", "eval"):
        assert command in out.stdout
    out = run_cli("config", str(DEFAULT), "trainer.total_steps=3")
    assert out.returncode == 0, out.stderr
    import yaml
    resolved = yaml.safe_load(out.stdout)
    assert resolved["trainer"]["total_steps"] == 3
    assert resolved["model"]["arch"]["num_layers"] == 30


def test_cli_config_error_exit_code_names_field():
    out = run_cli("config", str(DEFAULT), "rollout.n_per_prompt=1")
    assert out.returncode == 2
    assert "rollout.n_per_prompt:" in out.stderr


ONE_GPU = ["cluster.device=cuda", "cluster.gpus_per_node=1", "cluster.backend=local", "rollout.gpus=1",
           "model.dtype=bfloat16", "placement.mode=disaggregated"]


def test_off_policy_rollout_modes_need_disaggregated_placement():
    for mode in ("one_step_off", "async"):
        assert_one_problem([f"rollout.mode={mode}"], "rollout.mode", "colocated", "placement.mode=disaggregated")
    assert not problems_for(["rollout.mode=async", "placement.mode=disaggregated", "rollout.max_staleness=3"])
    assert_one_problem(["rollout.mode=one_step_off", "placement.mode=disaggregated", "rollout.max_staleness=2"],
                       "rollout.max_staleness", "one version behind")


def test_one_gpu_may_be_shared_by_trainer_and_rollout_disaggregated():
    """One H200: trainer (backend local) and one server share the device, both keeping their memory
    (no memory saver, no release/resume) and pushing by CUDA IPC (NCCL refuses two ranks on a GPU)."""
    from pathlib import Path as P

    from megarl.rollout.launch import LaunchSpec, sglang_args
    from megarl.config.validate import push_transport

    for mode in ("sync", "one_step_off", "async"):
        assert not problems_for(ONE_GPU + [f"rollout.mode={mode}"]), mode
    cfg = load_config(DEFAULT, ONE_GPU + ["rollout.mode=async"])
    assert push_transport(cfg) == "tensor"
    assert "--enable-memory-saver" not in sglang_args(cfg, P("/m"), LaunchSpec(0, "127.0.0.1", 1))
    assert_one_problem(ONE_GPU + ["sync.transport=nccl"], "sync.transport", "two ranks on one GPU")
    # with Ray (pools placed apart) or a critic, one GPU is not enough
    assert_one_problem(ONE_GPU + ["cluster.backend=ray"], "rollout.gpus", "need actor + critic + rollout = 2",
                       "one GPU may be shared")
    # two GPUs apart: a broadcast group, as before
    two = load_config(DEFAULT, ONE_GPU + ["cluster.gpus_per_node=2"])
    assert push_transport(two) == "distributed"
