"""--scale-search mse (kernels/search.py): never worse than absmax per block, a real gain on
heavy-tailed weights, Triton byte-identical to the torch reference, `none` unchanged, recorded in
the manifest, model card and inspect, and reproduced byte for byte by verify --exact."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantcli.formats.facts import ModuleFacts
from quantcli.kernels import dequantize, quantize, search, triton_available
from quantcli.kernels import reference as R
from quantcli.recipes import RECIPES
from quantcli.testing import make_llama

SEARCHED = ("nvfp4", "mxfp4", "mxfp8")


def weights(kind: str, shape=(64, 256), seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(shape, generator=g) * 0.02
    u = torch.rand(shape, generator=g).clamp(1e-7, 1 - 1e-7)
    if kind == "laplace":
        return -0.02 * torch.sign(u - 0.5) * torch.log1p(-2 * (u - 0.5).abs())
    torch.manual_seed(seed)  # Student-t, 3 degrees of freedom
    return torch.distributions.StudentT(3.0).sample(shape) * 0.02


def block_sq_error(x, spec, q) -> torch.Tensor:
    """Squared error per block [N, K / G], in float64 from the real dequantized values."""
    d = dequantize(q, spec, tuple(x.shape), backend="torch").double() - x.double()
    return (d * d).reshape(x.shape[0], -1, spec.group).sum(-1)


def mse_spec(name: str):
    return replace(RECIPES[name].spec, scale_search="mse")


def _step_first_block_scale(dst, name: str) -> None:
    """Move the first E4M3 block scale of `name` in DST's shard one code up (or down at the top)."""
    shard = next(dst.glob("*.safetensors"))
    tensors = load_file(shard)
    raw = tensors[name].view(torch.uint8).clone()
    raw[0, 0] = raw[0, 0] + 1 if raw[0, 0] < 0x7E else raw[0, 0] - 1
    tensors[name] = raw.view(torch.float8_e4m3fn)
    save_file(tensors, shard, metadata={"format": "pt"})


@pytest.mark.parametrize("kind", ["normal", "laplace", "student-t"])
@pytest.mark.parametrize("name", SEARCHED)
def test_never_worse_than_absmax_per_block(name, kind):
    x = weights(kind)
    plain, searched = RECIPES[name].spec, mse_spec(name)
    e_abs = block_sq_error(x, plain, quantize(x, plain, backend="torch"))
    e_mse = block_sq_error(x, searched, quantize(x, searched, backend="torch"))
    # The search compares FP32 sums; float64 may see a tie as a hair worse.
    assert bool((e_mse <= e_abs * (1 + 1e-5) + 1e-30).all())
    assert float(e_mse.sum()) <= float(e_abs.sum())


def test_nvfp4_laplace_mse_drops_at_least_15_percent():
    x = weights("laplace", (256, 1024))
    plain, searched = RECIPES["nvfp4"].spec, mse_spec("nvfp4")
    e_abs = float(block_sq_error(x, plain, quantize(x, plain, backend="torch")).sum())
    e_mse = float(block_sq_error(x, searched, quantize(x, searched, backend="torch")).sum())
    assert e_mse <= 0.85 * e_abs, (e_mse, e_abs)


def test_global_scale_unchanged_and_shared():
    x = weights("laplace")
    amax = torch.tensor(0.5)  # a fused group's amax, above this tensor's own
    a = quantize(x, RECIPES["nvfp4"].spec, global_amax=amax, backend="torch")
    b = quantize(x, mse_spec("nvfp4"), global_amax=amax, backend="torch")
    assert torch.equal(a.global_scale, b.global_scale)
    assert not torch.equal(a.scale, b.scale)


def test_chosen_codes_stay_in_the_window_and_ties_keep_absmax():
    x = weights("laplace")
    x[0, :16] = 0  # an all-zero block: every candidate errs 0, the absmax code stays
    plain, searched = RECIPES["nvfp4"].spec, mse_spec("nvfp4")
    a, b = quantize(x, plain, backend="torch"), quantize(x, searched, backend="torch")
    step = b.scale.int() - a.scale.int()
    assert int(step.min()) >= -3 and int(step.max()) <= 7
    assert int(b.scale[0, 0]) == int(a.scale[0, 0]) == 0x38


def test_activation_weights_protect_the_heavy_channels():
    x = weights("laplace", (64, 256))
    ms = torch.ones(256)
    ms[::5] = 100.0  # channels the layer's output depends on most, inside every block
    searched = mse_spec("nvfp4")
    data_free = quantize(x, searched, backend="torch")
    weighted = quantize(x, searched, backend="torch", channel_weight=ms)
    assert not torch.equal(data_free.scale, weighted.scale)

    def output_error(q):  # E[(x (W - Wq)^T)^2] for inputs with per-channel mean square `ms`
        d = dequantize(q, searched, tuple(x.shape), backend="torch") - x
        return float((d * d * ms).sum())

    assert output_error(weighted) < output_error(data_free)
    # The recipe reads them from the module's facts.
    recipe = RECIPES["nvfp4"].with_scale_search("mse")
    q = recipe.quantize("m.weight", x, backend="torch", facts=ModuleFacts(input_channel_ms=ms))
    assert torch.equal(q.scale, weighted.scale)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("name,rule", [("nvfp4", None), ("mxfp4", "even"), ("mxfp4", "rceil"), ("mxfp8", "floor"),
                                       ("mxfp8", "even")])
def test_triton_matches_torch(name, rule):
    spec = mse_spec(name) if rule is None else replace(mse_spec(name), scale_rule=rule)
    x = weights("student-t", (37, 96), seed=3).to(torch.bfloat16)
    x[0, :32] = 0
    ms = torch.rand(96, generator=torch.Generator().manual_seed(1)) ** 3
    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled kernels there, else the interpreter
    for w in (None, ms):
        a = quantize(x, spec, backend="torch", channel_weight=w)
        b = quantize(x.to(device), spec, backend="triton", channel_weight=w)
        assert torch.equal(a.codes, b.codes.cpu()) and torch.equal(a.scale, b.scale.cpu())


def test_recipes_that_cannot_search_stay_absmax():
    assert RECIPES["fp8"].with_scale_search("mse") is RECIPES["fp8"]
    assert RECIPES["nvfp4"].with_scale_search("none") is RECIPES["nvfp4"]
    assert search.window(mse_spec("mxfp4")) == (1, -1)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("ss") / "llama", hidden=64, layers=1, shards=1)


def test_convert_records_the_method_and_verify_exact_reproduces_it(run_cli, llama, tmp_path):
    dst = tmp_path / "mse"
    assert run_cli("convert", llama, dst, "--recipe", "nvfp4", "--scale-search", "mse", "-q")[0] == 0
    manifest = json.loads((dst / "quantcli_manifest.json").read_text())
    assert {m["scale_search"] for m in manifest["modules"]} == {"mse"}
    assert "mse search" in (dst / "README.md").read_text()
    code, out, _ = run_cli("verify", dst, "--reference", llama, "--exact", "--json")
    assert code == 0, out
    rows = json.loads(out)["tensors"]
    assert all(r["exact_identical_fraction"] == 1.0 and r["rel_err"] < r["absmax_rel_err"] for r in rows)
    code, out, _ = run_cli("inspect", dst, "--json")
    assert code == 0 and out.count('"scale_rule": "absmax + mse search"') == 7

    # One block scale changed after convert: --exact names the module.
    _step_first_block_scale(dst, "model.layers.0.mlp.down_proj.weight_scale")
    code, out, _ = run_cli("verify", dst, "--reference", llama, "--exact")
    assert code == 1 and "down_proj" in out and "bytes were changed" in out


def test_none_is_todays_bytes_and_config_file_takes_the_key(run_cli, llama, tmp_path):
    plain, none = tmp_path / "plain", tmp_path / "none"
    assert run_cli("convert", llama, plain, "--recipe", "mxfp4", "-q")[0] == 0
    assert run_cli("convert", llama, none, "--recipe", "mxfp4", "--scale-search", "none", "-q")[0] == 0
    for f in plain.iterdir():
        if f.is_file():
            assert f.read_bytes() == (none / f.name).read_bytes(), f.name
    assert "scale_search" not in (plain / "quantcli_manifest.json").read_text()
    toml = tmp_path / "r.toml"
    toml.write_text('recipe = "mxfp4"\nscale_search = "mse"\n')
    assert run_cli("convert", llama, tmp_path / "cfg", "--config", toml, "-q")[0] == 0
    assert '"scale_search": "mse"' in (tmp_path / "cfg" / "quantcli_manifest.json").read_text()


def test_fp8_only_refuses_the_search(run_cli, llama, tmp_path):
    code, _, err = run_cli("convert", llama, tmp_path / "x", "--recipe", "fp8", "--scale-search", "mse")
    assert code == 2 and "--scale-search mse" in err and "nvfp4" in err
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------- the definition, as the oracle
# kernels/search.py computes the criterion batched, with cheaper rounding ops; this is its
# definition written out op by op (what the Triton kernel computes), one candidate at a time.


def oracle_on_grid(y, element):
    if element == "e4m3":
        return R.decode_e4m3(R.encode_e4m3(y))
    inv = torch.where(y < 2.0, 2.0, torch.where(y < 4.0, 1.0, 0.5))
    return torch.floor(y * inv + 0.5).div_(inv).clamp_max_(6.0)


def oracle_block_error(ax, den, element, weight):
    dd = den.unsqueeze(-1)
    d = oracle_on_grid(ax / dd, element).mul_(dd).sub_(ax)
    e = d.mul_(d)
    e = e if weight is None else e.mul_(weight)
    while e.shape[-1] > 1:
        h = e.shape[-1] // 2
        e = e[..., :h] + e[..., h:]
    return e[..., 0]


def oracle_quantize(x, spec, weight=None):
    s2 = R.global_scale_for(x, spec, None)
    g = R._groups(x.float(), spec.group)
    ax = g.abs()
    code0, den0 = R.encode_scale(ax.amax(-1), spec, s2)
    w = search.channel_weight_groups(weight, x.shape[-1], spec.group, x.device)
    lo, hi = search.code_range(spec)
    best, best_den = code0.to(torch.int32), den0
    best_err = oracle_block_error(ax, den0, spec.element.name, w)
    for step in search.window(spec):
        cand = code0.to(torch.int32) + step
        valid = (cand >= lo) & (cand <= hi)
        cand = cand.clamp(lo, hi)
        den = R.decode_e4m3(cand.to(torch.uint8)) * s2 if s2 is not None else R.e8m0_to_float(cand.to(torch.uint8))
        err = oracle_block_error(ax, den, spec.element.name, w)
        better = valid & (err < best_err)
        best_err, best, best_den = (torch.where(better, err, best_err), torch.where(better, cand, best),
                                    torch.where(better, den, best_den))
    codes = R.encode_elements((g / best_den.unsqueeze(-1)).reshape(x.shape), spec.element)
    return codes, best.to(torch.uint8)


def edge_blocks(x, group):
    """Blocks that reach the ends of the scale code range and the rounding corner cases."""
    x[0, :group] = 0
    x[1, :group] *= 1e-30
    x[2, :group] = torch.linspace(-1e-38, 1e-38, group)  # FP32 subnormal block: E8M0 byte 0
    x[3, :group] = 2.0 ** torch.arange(group, dtype=torch.float32).remainder(7).neg()  # on-grid values
    return x


@pytest.mark.parametrize("kind", ["normal", "laplace", "student-t"])
@pytest.mark.parametrize("name,rule", [("nvfp4", None), ("mxfp4", "even"), ("mxfp4", "floor"), ("mxfp4", "rceil"),
                                       ("mxfp8", "floor"), ("mxfp8", "even"), ("mxfp8", "rceil")])
def test_batched_search_equals_the_definition(name, rule, kind):
    spec = mse_spec(name) if rule is None else replace(mse_spec(name), scale_rule=rule)
    x = edge_blocks(weights(kind, (70, 512), seed=7).to(torch.bfloat16).float(), spec.group)
    x[4:6] *= 1e4  # a few rows far above the rest: other blocks sit near the bottom of the window
    ms = torch.rand(512, generator=torch.Generator().manual_seed(2)) ** 4
    ms[:3] = 0  # dead channels
    for w in (None, ms):
        q = quantize(x, spec, backend="torch", channel_weight=w)
        codes, scale = oracle_quantize(x, spec, w)
        assert torch.equal(q.codes, codes) and torch.equal(q.scale, scale)


def test_tiny_global_scale_takes_the_unhalved_path():
    """s2 below 2^-116 (an all-tiny tensor): halving the NVFP4 divisors would not be exact."""
    x = weights("laplace", (16, 256), seed=5) * 1e-34
    spec = mse_spec("nvfp4")
    assert float(R.global_scale_for(x, spec, None)) < search.EXACT_HALF_S2
    q = quantize(x, spec, backend="torch")
    codes, scale = oracle_quantize(x, spec)
    assert torch.equal(q.codes, codes) and torch.equal(q.scale, scale)


def test_fast_rounding_equals_the_definition_near_every_threshold():
    """Every FP32 value within 64 ulps of each rounding threshold and grid point, plus a random
    sample; (the full non-negative FP32 range was checked once, by scripts/check_scale_search_grid.py)."""
    points = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0,
              *(float(v) for v in R.decode_e4m3(torch.arange(0, 127, dtype=torch.uint8))), 456.0, 464.0, 480.0]
    mids = [(a + b) / 2 for a, b in zip(points, points[1:])]
    bits = torch.tensor(points + mids, dtype=torch.float32).view(torch.int32)
    near = (bits.unsqueeze(1) + torch.arange(-64, 65, dtype=torch.int32)).clamp_min(0).reshape(-1)
    g = torch.Generator().manual_seed(0)
    sample = torch.randint(0, 0x7F800001, (1 << 16,), generator=g, dtype=torch.int32)
    y = torch.cat((near, sample, torch.tensor([0x7F800000], dtype=torch.int32))).view(torch.float32)
    scratch = torch.empty(y.shape, dtype=torch.int32)
    assert torch.equal(search.e4m3_grid_(y.clone(), scratch), oracle_on_grid(y.clone(), "e4m3"))
    y = y[y < 1e38]  # the doubled grid takes t = 2y
    scratch = torch.empty(y.shape, dtype=torch.int32)
    assert torch.equal(search.e2m1_grid_x2_(y * 2, scratch) * 0.5, oracle_on_grid(y.clone(), "e2m1"))


def test_e4m3_scale_codes_decode_by_bits_as_by_cast():
    codes = torch.arange(0, 127, dtype=torch.int32)
    s2 = torch.tensor(0.37)
    assert torch.equal(search.decode_code(codes, mse_spec("nvfp4"), s2), R.decode_e4m3(codes.to(torch.uint8)) * s2)


def test_requantizing_a_quantized_source_searches_and_relayout_keeps_its_scales(run_cli, llama, tmp_path):
    src = tmp_path / "fp8"
    assert run_cli("convert", llama, src, "--recipe", "fp8-block", "-q")[0] == 0
    plain, searched = tmp_path / "plain", tmp_path / "mse"
    assert run_cli("convert", src, plain, "--recipe", "nvfp4", "-q")[0] == 0
    code, _, err = run_cli("convert", src, searched, "--recipe", "nvfp4", "--scale-search", "mse", "-q")
    assert code == 0, err
    manifest = json.loads((searched / "quantcli_manifest.json").read_text())
    assert {(m["scale_search"], m["requantized_from"]) for m in manifest["modules"]} == {("mse", "fp8-block")}
    shard = next(searched.glob("*.safetensors")).name
    a, b = load_file(plain / shard), load_file(searched / shard)
    name = "model.layers.0.mlp.down_proj.weight_scale"
    assert not torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8))
    # nvfp4 -> nvfp4 in another layout copies the bytes: no search chose them, none is recorded.
    code, _, err = run_cli("convert", searched, tmp_path / "ct", "--recipe", "nvfp4", "--layout",
                           "compressed-tensors", "--scale-search", "mse")
    assert code == 0 and "re-laid out byte for byte" in err
    assert "scale_search" not in (tmp_path / "ct" / "quantcli_manifest.json").read_text()
    code, _, err = run_cli("convert", src, tmp_path / "x", "--recipe", "fp8", "--scale-search", "mse")
    assert code == 2 and "--scale-search mse" in err and not (tmp_path / "x").exists()


def test_weighted_search_is_recorded_and_verify_exact_reproduces_it_with_the_calibration(run_cli, tmp_path):
    """--calibration weights the search: the manifest says so per module; verify --exact re-runs
    the calibration (--calibration DATA) and compares bytes, and without it says, in a note, that
    those modules need it (no byte check, no false fault)."""
    pytest.importorskip("transformers")
    from test_calibrate_verify import _tokenizer, _words

    src = make_llama(tmp_path / "llama", hidden=64, layers=1, shards=1)
    _tokenizer(src)
    data = tmp_path / "cal.txt"
    data.write_text("\n".join(_words(i) for i in range(6)) + "\n")
    dst = tmp_path / "w"
    code, _, err = run_cli("convert", src, dst, "--recipe", "nvfp4", "--scale-search", "mse",
                           "--calibration", data, "-q")
    assert code == 0, err
    modules = json.loads((dst / "quantcli_manifest.json").read_text())["modules"]
    assert {(m["scale_search"], m.get("scale_search_weights")) for m in modules} == {("mse", "input_channel_ms")}

    code, out, _ = run_cli("verify", dst, "--reference", src, "--exact", "--calibration", data, "--json")
    report = json.loads(out)
    assert code == 0, report["faults"]
    assert all(r["exact_identical_fraction"] == 1.0 for r in report["tensors"])
    code, out, _ = run_cli("verify", dst, "--reference", src, "--exact", "--json")
    report = json.loads(out)
    assert code == 0 and any("--calibration DATA" in n for n in report["notes"])
    assert any(r["exact_identical_fraction"] < 1.0 for r in report["tensors"])  # data-free differs: not checked

    # A changed block scale: with the calibration, --exact names the module.
    _step_first_block_scale(dst, "model.layers.0.self_attn.o_proj.weight_scale")
    code, out, _ = run_cli("verify", dst, "--reference", src, "--exact", "--calibration", data)
    assert code == 1 and "o_proj" in out and "bytes were changed" in out
