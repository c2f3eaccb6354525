"""GPTQ's bytes pinned (tests/data/output_pins.json holds no GPTQ output): the SHA-256 of the codes,
the scales and the global scale gptq_quantize writes for one seeded weight and H, per recipe and
settings. The pins are main's bytes at df78b65 (before the loop was rewritten in the paper's
notation); a change to rounding/ that moves one bit fails here. Regenerate only with a written
reason and a held-out accuracy check (docs/gptq.md, "Reproducible to the byte")."""

from __future__ import annotations

import hashlib

import pytest
import torch

from quantcli.formats.facts import NO_FACTS
from quantcli.recipes import get_recipe
from quantcli.rounding.gptq import GptqSettings, gptq_quantize

SETTINGS = {"default": GptqSettings(), "original": GptqSettings(scales="original"),
            "natural": GptqSettings(act_order="none"), "block64": GptqSettings(block_columns=64)}
PINS = {
    "fp8/default": "bfedb663e7af524f5a17624b771fa17a86c5bacf90babcaa4bf361edfa76acaf",
    "fp8/original": "bfedb663e7af524f5a17624b771fa17a86c5bacf90babcaa4bf361edfa76acaf",
    "fp8/natural": "3d2605ed50d27627de21c4775fefb58d0d5c2e53462dc2cd184688bb64cce3d2",
    "fp8/block64": "45176cbf0c719333c17bd8d0e3c2086a61b5981337d46f193c919442a8c9087e",
    "fp8-channel/default": "806a852756232405ad87c09d47c0ca8e7a5090e3817fd4f676612ffdf1bdd16e",
    "fp8-channel/original": "806a852756232405ad87c09d47c0ca8e7a5090e3817fd4f676612ffdf1bdd16e",
    "fp8-channel/natural": "7928b1c7789475dfb8535ab89882e060078f62e747f0472a9a02b9abf3e60ebb",
    "fp8-channel/block64": "8a3f3bf2d997989c12b9077089316136713768789cf484cbbde76f44b6512e41",
    "fp8-block/default": "22a47c3358b0d0a661472e94e6213930cd8fe8f021f66cc3978a381993118cb7",
    "fp8-block/original": "834136c29336c0a55721183001e29632156b43b80234a8da444e5f8a9ce4fe79",
    "fp8-block/natural": "0dd1095dd1db64d48e2bd456819cc7a1a02187d5fabab4f8eadd1d25d5edcc11",
    "fp8-block/block64": "3a6b19bdd88be2239991f45f64349402ee28ab6a4f8ba63b9856137a07baad4c",
    "mxfp8/default": "87521619a093c383c20e628473a397f6993d971b9dc1cb2799b69f59336ca305",
    "mxfp8/original": "c9f0dff8152f2355e59bea94547ee6923a96a1ca3bc5e4f82252c63e7d36b1fb",
    "mxfp8/natural": "014525d7c7fb119dabf68e9aa62a2283e48d6bd56f87f7d28eb47ee1c1247c62",
    "mxfp8/block64": "81f161f3d1fe99ba7943a70232129768923e12da033e3c06d7d69a79f5430442",
    "mxfp4/default": "1ed1871fada53d87fc88d0aac51c7c833b41fa83b47ab9cb081279b2114dd0cf",
    "mxfp4/original": "184ebedd85095caa0772c9ed5484a75552451458b60fc44e97f0e5cfc767fc5f",
    "mxfp4/natural": "0ac56bb7c53e422d79826d0492b48bba469fd891f28e4e2247895989f3daf95d",
    "mxfp4/block64": "1ed1871fada53d87fc88d0aac51c7c833b41fa83b47ab9cb081279b2114dd0cf",
    "nvfp4/default": "430b3c5b3e4b4f14c5847f04b1ec8c1d7af59ff3f5578db8b860d226b381fbc4",
    "nvfp4/original": "9da7289affd365490fd03bbaf983a957f0ac58f09c35f3389be24374123ea386",
    "nvfp4/natural": "fb55f42a5c097fb34f9dffcde07b2120d2dbeacd32e54b472052bb2a2c341d59",
    "nvfp4/block64": "4ed7a8857b26a4f1d2ac08bf2e1ec9becb432505ce1690236b522ae0685fd6cd",
    "int8-channel/default": "8ecc514a1df368b0f918ae1744b0e31d794d1367c55ce4bcfd38566abd84bdf5",
    "int8-channel/original": "8ecc514a1df368b0f918ae1744b0e31d794d1367c55ce4bcfd38566abd84bdf5",
    "int8-channel/natural": "d283a1a3b7db4d60059eda0994b5fe61958880b68606a5d731bc3545d88f5d88",
    "int8-channel/block64": "8ecc514a1df368b0f918ae1744b0e31d794d1367c55ce4bcfd38566abd84bdf5",
    "int4/default": "021365abc1ebda44d7af3abab71dd3cb1c9c0db25212a7b021542b6b75c37914",
    "int4/original": "f95f9bc1d7c282351a2eb0c2f4698a6539b75aa279d77a169c5bc71ccd92a1e0",
    "int4/natural": "78e670d44cfeff5c31d689d0e90dc80d4eba1e6ecff7bdb2e6f25342b4af76e8",
    "int4/block64": "021365abc1ebda44d7af3abab71dd3cb1c9c0db25212a7b021542b6b75c37914",
}


def case(recipe_name: str, settings: GptqSettings) -> str:
    """The digest of what GPTQ writes for a seeded [160, 384] BF16 weight with uneven input scales."""
    g = torch.Generator().manual_seed(7)
    k = 384
    w = (torch.randn(160, k, generator=g) * torch.linspace(0.2, 3, k)).to(torch.bfloat16)
    x = torch.randn(600, k, generator=g, dtype=torch.float64) * torch.rand(k, generator=g, dtype=torch.float64) * 3
    out = gptq_quantize("w", w, x.T @ x, get_recipe(recipe_name), NO_FACTS, settings)
    assert out.method == "gptq", out.reason  # pins of round to nearest would test nothing here
    digest = hashlib.sha256(out.method.encode())
    for t in (out.q.codes, out.q.scale, out.q.global_scale):
        if t is not None:
            digest.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("key", sorted(PINS))
def test_gptq_bytes_equal_the_pins(key):
    recipe_name, settings = key.split("/")
    assert case(recipe_name, SETTINGS[settings]) == PINS[key]
