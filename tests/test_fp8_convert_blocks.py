"""`megarl convert hf-to-fp8` on models whose projection dims are not whole 128-blocks: the line it
prints and the record it writes say which loaders read the result right, checked against each
loader's own code -- transformers' FP8 dequantizer and `from_pretrained`, SGLang 0.5.23's block-FP8
shape check (its CPU environment), and the embedded engine's forward.

Three tiny Llamas (2 layers, 2 heads of 64): `aligned` (hidden 128, intermediate 256), `i320`
(intermediate 320: transformers refuses it, SGLang refuses its fused gate/up) and `h192` (hidden 192,
intermediate 384: transformers silently reads 96x96 blocks, SGLang's fused parts are whole blocks).
"""
from __future__ import annotations

import contextlib
import io
import json
import subprocess
from pathlib import Path

import pytest
import torch

from megarl.checkpoint.cli import convert_main
from megarl.checkpoint.fp8_convert import convert_hf_to_fp8, fp8_quantization_config, read_quantized, unreadable
from megarl.quant.fp8_block import dequantize_block_fp8
from tests.sglang_cpu.server import ROOT, harness_env, sglang_cpu_python

SHAPES = {"aligned": (128, 256), "i320": (128, 320), "h192": (192, 384)}   # (hidden, intermediate)
IDS = [1, 17, 42, 99, 7, 64, 3, 250]


def _tiny(path: Path, hidden: int, intermediate: int) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=64,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (base folder, FP8 folder, the lines the conversion printed on stderr)."""
    root = tmp_path_factory.mktemp("fp8_blocks")
    out = {}
    for name, (hidden, intermediate) in SHAPES.items():
        base = _tiny(root / name, hidden, intermediate)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            convert_hf_to_fp8(str(base), str(root / f"{name}_fp8"), verbose=False)
        out[name] = (base, root / f"{name}_fp8", err.getvalue().strip().splitlines())
    return out


def _readers(fp8: Path):
    return json.loads((fp8 / "config.json").read_text()).get("megarl_fp8_readers")


def _flagged(base: Path, loader: str) -> dict:
    """The weights the conversion says ``loader`` cannot read."""
    return unreadable(sorted(base.glob("*.safetensors"))).get(loader, {})


def _scaled(fp8: Path) -> dict:
    """name -> (fp8 weight, scale grid) of every quantized weight."""
    from safetensors.torch import load_file

    t = load_file(str(fp8 / "model.safetensors"))
    return {n: (w, t[n + "_scale_inv"]) for n, w in t.items() if n + "_scale_inv" in t}


def test_convert_says_which_loaders_read_it(converted):
    _, fp8, lines = converted["aligned"]
    assert lines == [] and _readers(fp8) is None
    for _, fp8, _ in converted.values():   # the format's own keys, whatever the readers
        assert json.loads((fp8 / "config.json").read_text())["quantization_config"] == fp8_quantization_config()
    _, fp8, lines = converted["i320"]
    assert len(lines) == 1 and lines[0].startswith("[megarl.convert] warning:"), lines
    assert _readers(fp8) == {
        "megarl serve": "reads",
        "sglang": "refuses at start: fused q/k/v or gate/up rows not a multiple of 128 (4 weight(s), e.g. "
                  "model.layers.0.mlp.gate_proj.weight [320, 128])",
        "transformers": "misreads or refuses: a dim above 128 not a multiple of 128, the block is inferred from the "
                        "scale grid (6 weight(s), e.g. model.layers.0.mlp.down_proj.weight [128, 320])"}
    assert all(v in lines[0] for v in _readers(fp8).values())
    _, fp8, lines = converted["h192"]
    readers = _readers(fp8)
    assert len(lines) == 1 and readers["sglang"] == "reads at TP 1" and readers["megarl serve"] == "reads"
    assert readers["transformers"].endswith("(14 weight(s), e.g. model.layers.0.mlp.down_proj.weight [192, 384])")


def test_flagged_for_transformers_is_what_its_own_loader_gets_wrong(converted):
    """Per weight, transformers' own dequantizer differs from the block the checkpoint declares (or
    raises) exactly for the weights the conversion counted; `from_pretrained` refuses i320, silently
    loads wrong h192 weights, and loads `aligned` exactly."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    for name, (base, fp8, _) in converted.items():
        wrong = set()
        for w, (q, s) in _scaled(fp8).items():
            ours = dequantize_block_fp8(q, s, dtype=torch.float32)
            try:
                if not torch.equal(Fp8Dequantize(None)._dequantize_one(q, s, torch.float32), ours):
                    wrong.add(w)
            except ValueError:   # "Weight shape (320, 128) not divisible by scale grid (3, 1)"
                wrong.add(w)
        assert wrong == set(_flagged(base, "transformers")), name
        assert len(wrong) == {"aligned": 0, "i320": 6, "h192": 14}[name]
    with pytest.raises(Exception, match="CONVERSION"):
        AutoModelForCausalLM.from_pretrained(str(converted["i320"][1]), dtype=torch.float32)
    for name, misread in (("aligned", 0), ("h192", 14)):
        fp8 = converted[name][1]
        state = AutoModelForCausalLM.from_pretrained(str(fp8), dtype=torch.float32).state_dict()
        deq = read_quantized(str(fp8))
        assert sum(not torch.equal(state[n], deq[n]) for n in _scaled(fp8)) == misread, name


_SGLANG_CHECK = r"""
import json, sys, types
import tests.sglang_cpu  # noqa: F401
from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod
out = {}
for name, (config, quant) in json.loads(sys.argv[1]).items():
    fp8 = Fp8Config.from_config(quant)
    h, kv, i = config["hidden_size"], config["num_key_value_heads"] * config["head_dim"], config["intermediate_size"]
    for fused, parts in (("qkv_proj", [config["num_attention_heads"] * config["head_dim"], kv, kv]),
                         ("gate_up_proj", [i, i])):
        try:
            Fp8LinearMethod.validate_block_quant_shapes(types.SimpleNamespace(tp_group=None), fp8, h, h,
                                                        sum(parts), sum(parts), parts)
            out[f"{name}/{fused}"] = "ok"
        except ValueError as err:
            out[f"{name}/{fused}"] = str(err)
print(json.dumps(out))
"""


def test_flagged_for_sglang_is_what_its_own_shape_check_refuses(converted):
    """SGLang 0.5.23's block-FP8 linear (TP 1) refuses the fused layers of exactly the weights the
    conversion counted (reading the conversion's own quantization_config)."""
    configs = {name: json.loads((fp8 / "config.json").read_text()) for name, (_, fp8, _) in converted.items()}
    arg = {name: (c, c["quantization_config"]) for name, c in configs.items()}
    done = subprocess.run([sglang_cpu_python(), "-c", _SGLANG_CHECK, json.dumps(arg)], capture_output=True,
                          text=True, env=harness_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    for name, (base, _, _) in converted.items():
        leaves = {w.rsplit(".", 2)[-2] for w in _flagged(base, "sglang")}
        assert (seen[f"{name}/qkv_proj"] != "ok") == bool(leaves & {"q_proj", "k_proj", "v_proj"}), name
        assert (seen[f"{name}/gate_up_proj"] != "ok") == bool(leaves & {"gate_proj", "up_proj"}), name
    assert seen == {"aligned/qkv_proj": "ok", "aligned/gate_up_proj": "ok", "i320/qkv_proj": "ok",
                    "i320/gate_up_proj": "Weight output_partition_size = 320 is not divisible by weight "
                                         "quantization block_n = 128.",
                    "h192/qkv_proj": "ok", "h192/gate_up_proj": "ok"}, seen


def test_megarl_serve_reads_every_one(converted):
    """The embedded engine serving each FP8 folder computes what transformers computes from the
    weights the checkpoint declares (megarl's dequantization, 128x128 blocks with padded tails)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.engine.model import DecoderModel

    for name, (base, fp8, _) in converted.items():
        ref = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
        ref.load_state_dict({**ref.state_dict(), **read_quantized(str(fp8))})
        engine = DecoderModel(AutoConfig.from_pretrained(fp8))
        engine.load_hf_dir(str(fp8))
        with torch.no_grad():
            assert (engine.forward_full(IDS) - ref(torch.tensor([IDS])).logits[0]).abs().max().item() < 1e-4, name


def test_cli_readable_by_refuses_in_one_line_and_writes_nothing(converted, tmp_path, capsys):
    h192 = str(converted["h192"][0])
    assert convert_main(["hf-to-fp8", "--hf", h192, "--out", str(tmp_path / "t"), "--readable-by", "transformers"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megarl convert: error: --readable-by transformers: "), err
    assert not (tmp_path / "t").exists() and not list(tmp_path.glob(".t.tmp-*"))
    i320 = str(converted["i320"][0])
    assert convert_main(["hf-to-fp8", "--hf", i320, "--out", str(tmp_path / "s"), "--readable-by", "sglang"]) == 1
    assert "--readable-by sglang: " in capsys.readouterr().err and not (tmp_path / "s").exists()
    assert convert_main(["hf-to-fp8", "--hf", i320, "--out", str(tmp_path / "x"), "--readable-by", "vllm"]) == 1
    assert "--readable-by: ['vllm']" in capsys.readouterr().err
    # SGLang reads h192: asked for, it is written, with the warning about transformers
    assert convert_main(["hf-to-fp8", "--hf", h192, "--out", str(tmp_path / "ok"), "--readable-by", "sglang",
                         "--quiet"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "transformers: misreads" in err[0], err
    assert _readers(tmp_path / "ok")["sglang"] == "reads at TP 1"
