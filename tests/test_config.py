"""Build config: shipped files parse, defaults in code equal configs/default.toml, bad keys and values fail."""
import dataclasses

import pytest

from sift.errors import SiftError
from sift.pipeline.config import CONFIGS_DIR, BuildConfig, load_config, load_config_dict


def test_default_toml_equals_builtin_defaults():
    assert load_config(CONFIGS_DIR / "default.toml") == BuildConfig()


def test_shipped_configs_parse_and_round_trip():
    for path in sorted(CONFIGS_DIR.glob("*.toml")):
        cfg = load_config(path)
        assert load_config_dict(cfg.to_dict()) == cfg
    assert load_config(CONFIGS_DIR / "llama3-8b.toml").profile.dtype == "bfloat16"


def test_cli_overrides_and_profile_key():
    base = load_config()
    cfg = load_config(tile=32, alpha=0.01, model="/models/x")
    assert (cfg.profile.tile, cfg.profile.alpha, cfg.model) == (32, 0.01, "/models/x")
    assert cfg.profile_key("fp", 1) != base.profile_key("fp", 1)
    assert base.profile_key("fp", 1) != base.profile_key("other-model", 1)
    # corpus and build settings do not change the bits, so they do not change the key
    other = dataclasses.replace(base, build=dataclasses.replace(base.build, shard_rows=7, batch_tokens=100,
                                                                 shard_tokens=5))
    assert other.profile_key("fp", 1) == base.profile_key("fp", 1)

    # ca_full_layers decides bits; left empty it keeps the key the default config had before the key existed,
    # so indexes built then stay reusable (the hash below is that older key, recorded by hand)
    assert base.profile_key("fp", 1) == "8bcdf0f11d7a25283950584a72112ff73650abc43da6d9db5dabc46904589b37"
    guarded = dataclasses.replace(base, profile=dataclasses.replace(base.profile, ca_full_layers=[17, 3, 3]))
    assert guarded.profile.ca_full_layers == (3, 17)
    assert guarded.profile_key("fp", 1) != base.profile_key("fp", 1)
    by_head = dataclasses.replace(base, profile=dataclasses.replace(base.profile, ca_full_heads=[[5, 2], [0, 1]]))
    assert by_head.profile.ca_full_heads == ((0, 1), (5, 2))
    assert len({by_head.profile_key("fp", 1), guarded.profile_key("fp", 1), base.profile_key("fp", 1)}) == 3


@pytest.mark.parametrize("text, message", [
    ("[profile]\ntiles = 16\n", "profile.tiles"),
    ("modle = 'x'\n", "modle"),
    ("[profile]\ntile = 48\n", "tile = 48"),
    ("[profile]\nalpha = 2.0\n", "alpha"),
    ("[profile]\nca_normalize = 'rows'\n", "ca_normalize"),
    ("[profile]\ndense_heads = [1, 2]\n", "dense_heads"),
    ("[profile]\nca_full_layers = [-1]\n", "ca_full_layers"),
    ("[profile]\nca_full_layers = ['x']\n", "ca_full_layers"),
    ("[profile]\nca_full_heads = [1, 2]\n", "ca_full_heads"),
    ("[profile]\nca_full_heads = [[0, -1]]\n", "ca_full_heads"),
    ("[corpus]\ntoo_long = 'truncate'\n", "too_long"),
    ("[corpus]\nfollow_symlinks = 'yes'\n", "follow_symlinks"),
    ("[build]\nbackend = 'cuda'\n", "backend"),
    ("[build]\nbatch_tokens = 0\n", "batch_tokens = 0 must be an integer >= 1"),
    ("[build]\nshard_tokens = 1.5\n", "shard_tokens"),
    ("[profile\n", "not valid TOML"),
])
def test_bad_config_is_one_clear_error(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SiftError, match=message):
        load_config(path)
