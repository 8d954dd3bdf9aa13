"""The pipeline split that validation and ``megarl plan`` assume is the one megatron-core builds.

* For every recipe and every Megatron role in it, ``planning.params.stage_chunks`` (what the plan
  counts and what ``workers.roles.check_pipeline_split`` enforces at start-up) equals what
  megatron-core's own ``get_num_layers_to_build`` / ``get_transformer_layer_offset`` give for each
  pipeline rank and virtual stage, through the TransformerConfig megarl builds
  (``transformer_config_from_hf`` with the role's parallel settings).
* Over a grid of layer counts, pp, vpp and uneven first / last stages: validation accepts exactly
  the layouts megatron-core's TransformerConfig accepts and builds.
* Real gloo ranks build the flagship layouts at reduced width (layer counts, expert counts and
  routing kept; TP and EP 1): each rank's megatron chunks hold the planned layers.
"""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.config.schema import ParallelConfig
from megarl.config.teacher import role_arch
from megarl.config.validate import _check_layer_split
from megarl.planning.params import stage_chunks

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def megatron_chunks(num_layers: int, p: ParallelConfig) -> list[list[list[int]]]:
    """Each pipeline rank's chunks as megatron-core computes them (no process group needed: the
    functions take the pipeline rank)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from dist_utils import tiny_hf_config
    from megarl.models import transformer_config_from_hf

    vpp = p.vpp if p.vpp > 1 else None
    config = transformer_config_from_hf(tiny_hf_config("llama", num_hidden_layers=num_layers), pp=p.pp, vpp=vpp,
                                        first_stage_layers=p.first_stage_layers,
                                        last_stage_layers=p.last_stage_layers)
    out = []
    for rank in range(p.pp):
        chunks = []
        for v in range(vpp or 1):
            stage = v if vpp else None
            start = get_transformer_layer_offset(config, vp_stage=stage, pp_rank=rank) if p.pp > 1 else 0
            chunks.append(list(range(start, start + get_num_layers_to_build(config, vp_stage=stage, pp_rank=rank))))
        out.append(chunks)
    return out


def planned(num_layers: int, p: ParallelConfig) -> list[list[list[int]]]:
    return [[list(c) for c in chunks] for chunks in stage_chunks(num_layers, p)]


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_every_recipe_plans_the_split_megatron_builds(recipe):
    cfg = load_config(recipe)
    assert cfg.model.arch.num_layers, f"{recipe.name}: model.arch.num_layers is needed to plan"
    for role in cfg.megatron_roles:
        p, num_layers = getattr(cfg, role).parallel, role_arch(cfg, role).num_layers   # a teacher: its own network
        want = megatron_chunks(num_layers, p)
        assert planned(num_layers, p) == want, (recipe.name, role)
        layers = sorted(i for chunks in want for c in chunks for i in c)
        assert layers == list(range(num_layers)), (recipe.name, role)


def test_flagship_recipes_are_uneven_as_written():
    """The big recipes rely on the uneven last stage: it reaches megatron (61 = 3 x 16 + 13, ...)."""
    splits = {}
    for name in ("deepseek-v3-671b-grpo", "deepseek-v3-671b-grpo-colocated", "qwen3-235b-a22b-dapo"):
        cfg = load_config(ROOT / "recipes" / f"{name}.yaml")
        chunks = megatron_chunks(cfg.model.arch.num_layers, cfg.actor.parallel)
        splits[name] = [sum(len(c) for c in r) for r in chunks]
    assert splits == {"deepseek-v3-671b-grpo": [16, 16, 16, 13],
                      "deepseek-v3-671b-grpo-colocated": [5] * 11 + [6],
                      "qwen3-235b-a22b-dapo": [24, 24, 24, 22]}


def megatron_accepts(num_layers: int, p: ParallelConfig) -> bool:
    try:
        chunks = megatron_chunks(num_layers, p)
    except (ValueError, AssertionError, ZeroDivisionError):   # ZeroDivisionError: uneven first + last, vpp, pp 2
        return False
    return sorted(i for r in chunks for c in r for i in c) == list(range(num_layers))


GRID = [ParallelConfig(pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)
        for pp, vpp, first, last in itertools.product((2, 3, 4), (1, 2, 3), (0, 1, 2, 4, 6), (0, 2, 3, 6))]


@pytest.mark.parametrize("num_layers", [6, 12, 13, 30])
def test_validation_accepts_exactly_the_splits_megatron_builds(num_layers):
    disagree = []
    for p in GRID:
        problems: list[str] = []
        _check_layer_split("actor", p, num_layers, problems)
        ok = megatron_accepts(num_layers, p)
        if ok != (not problems):
            disagree.append((p.pp, p.vpp, p.first_stage_layers, p.last_stage_layers, ok, problems))
        elif ok:
            assert planned(num_layers, p) == megatron_chunks(num_layers, p), p
        else:
            assert len(problems) == 1 and problems[0].startswith("actor.parallel."), problems
    assert not disagree, disagree


# ----------------------------------------------------------------------------- real ranks on gloo

def _built_layers(rank, world, hf_dir, layout):
    """Build this rank's megatron chunks as a role's worker does, and report their layers."""
    from megarl.models import build_model
    from megarl.models.builder import built_layers, unwrap
    from megarl.parallel import init_model_parallel

    init_model_parallel(pp=layout["pp"], vpp=layout.get("vpp"))
    chunks = build_model(hf_dir, vpp=layout.get("vpp"), perform_initialization=False,
                         first_stage_layers=layout.get("first", 0), last_stage_layers=layout.get("last", 0))
    from megatron.core import parallel_state as mpu

    experts = sorted({len(layer.mlp.experts.local_experts) for c in chunks for layer in unwrap(c).decoder.layers
                      if hasattr(layer.mlp, "experts")})
    return {"pp_rank": mpu.get_pipeline_model_parallel_rank(),
            "layers": built_layers(chunks),
            "experts": experts}


FLAGSHIPS = {
    # recipe: (family and the recipe's own depth / experts / routing at width 32-64)
    "deepseek-v3-671b-grpo": ("deepseek_v3", dict(num_hidden_layers=61, first_k_dense_replace=3,
                                                  n_routed_experts=256, num_experts_per_tok=8, n_group=8,
                                                  topk_group=4, hidden_size=32, moe_intermediate_size=8,
                                                  intermediate_size=32)),
    "qwen3-30b-a3b-grpo": ("qwen3_moe", dict(num_hidden_layers=48, num_experts=128, num_experts_per_tok=8,
                                             hidden_size=32, moe_intermediate_size=8, intermediate_size=32,
                                             head_dim=8)),
    "qwen3-235b-a22b-dapo": ("qwen3_moe", dict(num_hidden_layers=94, num_experts=128, num_experts_per_tok=8,
                                               hidden_size=32, moe_intermediate_size=8, intermediate_size=32,
                                               head_dim=8)),
}
FLAGSHIPS["deepseek-v3-671b-grpo-colocated"] = FLAGSHIPS["deepseek-v3-671b-grpo"]   # pp 12, last stage 6


@pytest.mark.parametrize("recipe", sorted(FLAGSHIPS))
def test_flagship_layout_builds_its_planned_stages_on_gloo_ranks(recipe, tmp_path):
    from dist_utils import tiny_hf_config
    from megarl.parallel import spawn

    cfg = load_config(ROOT / "recipes" / f"{recipe}.yaml")
    p = cfg.actor.parallel
    family, shape = FLAGSHIPS[recipe]
    hf = tiny_hf_config(family, **shape)
    assert hf.num_hidden_layers == cfg.model.arch.num_layers
    hf.save_pretrained(tmp_path)
    layout = {"pp": p.pp, "vpp": p.vpp if p.vpp > 1 else None, "first": p.first_stage_layers,
              "last": p.last_stage_layers}
    results = spawn(_built_layers, p.pp, str(tmp_path), layout)
    want = planned(cfg.model.arch.num_layers, p)
    for res in results:
        assert res["layers"] == want[res["pp_rank"]], (res["pp_rank"], res["layers"])
        assert res["experts"] == [cfg.model.arch.num_experts], res["experts"]   # ep 1: every expert local
