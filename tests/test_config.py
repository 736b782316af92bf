"""EngineConfig: keywords > environment > TOML file, and clear errors."""

from __future__ import annotations

import re

import msgspec
import pytest

from tokenflow import EngineConfig, SamplingParams
from tokenflow.errors import ConfigError


def test_defaults() -> None:
    config = EngineConfig.load(environ={})
    assert config.backend == "paged" and config.dtype == "auto" and config.block_size == 16


def test_precedence_keywords_over_environment_over_file(tmp_path) -> None:
    path = tmp_path / "tf.toml"
    path.write_text('[tokenflow]\nmax_num_seqs = 4\nblock_size = 32\ndtype = "bfloat16"\n')
    env = {"TOKENFLOW_MAX_NUM_SEQS": "8", "TOKENFLOW_DTYPE": "float16"}
    config = EngineConfig.load(config_file=path, environ=env, dtype="float32")
    assert config.block_size == 32  # file only
    assert config.max_num_seqs == 8  # environment over file
    assert config.dtype == "float32"  # keyword over environment


def test_top_level_toml_and_config_file_from_environment(tmp_path) -> None:
    path = tmp_path / "tf.toml"
    path.write_text('max_batch_tokens = 1024\nrequest_stages = ["redact"]\n')
    config = EngineConfig.load(environ={"TOKENFLOW_CONFIG": str(path)})
    assert config.max_batch_tokens == 1024


def test_environment_lists_and_none() -> None:
    env = {"TOKENFLOW_LENGTH_BUCKETS": "16, 64", "TOKENFLOW_REQUEST_STAGES": '["redact", "audit"]',
           "TOKENFLOW_MAX_MODEL_LEN": "none", "TOKENFLOW_SELF_CHECK": "false"}
    config = EngineConfig.load(environ=env)
    assert config.length_buckets == [16, 64]
    assert config.request_stages == ["redact", "audit"]
    assert config.max_model_len is None and config.self_check is False


@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16", "float16"])
def test_every_dtype_is_accepted(dtype: str) -> None:
    assert EngineConfig.load(environ={}, dtype=dtype).dtype == dtype


@pytest.mark.parametrize(
    ("kwargs", "env", "field"),
    [
        ({"dtype": "float64"}, {}, "dtype"),
        ({"max_num_seqs": 0}, {}, "max_num_seqs"),
        ({"no_such_setting": 1}, {}, "no_such_setting"),
        ({}, {"TOKENFLOW_NO_SUCH": "1"}, "no_such"),
        ({}, {"TOKENFLOW_BLOCK_SIZE": "big"}, "block_size"),
    ],
)
def test_invalid_settings_name_the_field(kwargs, env, field) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.load(environ=env, **kwargs)
    assert info.value.field == field
    assert field in str(info.value)


def test_bad_device_and_missing_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match="device"):
        EngineConfig.load(environ={}, device="tpu")
    with pytest.raises(ConfigError, match="not found"):
        EngineConfig.load(environ={}, config_file=tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("this is = = not toml")
    with pytest.raises(ConfigError, match="TOML"):
        EngineConfig.load(environ={}, config_file=bad)


def test_engine_keywords_build_the_config(tiny_model) -> None:
    from tokenflow import Engine

    engine = Engine(tiny_model, dtype="bfloat16", device="cpu", max_model_len=256)
    assert engine.config.dtype == "bfloat16" and engine.config.max_model_len == 256
    assert engine.config.model == str(tiny_model)
    with pytest.raises(ConfigError):
        Engine(tiny_model, max_modle_len=3)


def test_max_batch_tokens_defaults_per_device_unless_set() -> None:
    assert EngineConfig().max_batch_tokens is None  # decided once the model's device is known
    assert EngineConfig().for_device("cpu").max_batch_tokens == 512
    assert EngineConfig().for_device("cuda").max_batch_tokens == 2048
    assert EngineConfig(max_batch_tokens=96).for_device("cuda").max_batch_tokens == 96


async def test_a_started_engine_has_its_device_default(tiny_model) -> None:
    from tokenflow import Engine

    async with Engine(tiny_model) as engine:
        assert engine.config.max_batch_tokens == 512
        assert engine.stats()["max_batch_tokens_effective"] == 512


def test_environment_typos_are_refused_by_name_but_tool_variables_are_not() -> None:
    with pytest.raises(ConfigError, match=r"TOKENFLOW_MAX_NUM_SEQ\b.*max_num_seqs"):
        EngineConfig.load(environ={"TOKENFLOW_MAX_NUM_SEQ": "8"})
    tools = {name: "x" for name in ("TOKENFLOW_HOME", "TOKENFLOW_PLUGINS", "TOKENFLOW_API_KEY",
                                    "TOKENFLOW_TEST_MODEL", "TOKENFLOW_INDEX_URL", "TOKENFLOW_KERNEL_CFLAGS",
                                    "TOKENFLOW_VLLM_PYTHON")}  # the bench's peer interpreter (was refused)
    assert EngineConfig.load(environ=tools).max_num_seqs == EngineConfig.load(environ={}).max_num_seqs


def _descriptions() -> dict[str, str]:
    fields = msgspec.inspect.type_info(EngineConfig).fields
    return {f.name: (f.type.extra_json_schema or {}).get("description", "") for f in fields}


def test_every_setting_has_a_description_naming_only_real_settings() -> None:
    """The settings reference (docs/reference/settings.md) is generated from these descriptions: every field has
    one, and a setting a description names in backticks (`max_num_seqs`) exists, so a rename cannot leave one
    pointing nowhere. Other snake_case names there are request parameters, Engine methods or known values."""
    from tokenflow.engine import Engine

    descriptions = _descriptions()
    assert not [name for name, text in descriptions.items() if not text.strip()]
    known = (set(descriptions) | set(SamplingParams.__struct_fields__)
             | {name for name in dir(Engine) if not name.startswith("_")}
             | {"lfu_lru", "disk_tier", "redis_tier"})  # a policy's name; stage names of request_stages before 0.2
    named = {(field, name) for field, text in descriptions.items()
             for name in re.findall(r"`([a-z][a-z0-9]*(?:_[a-z0-9]+)+)`", text)}
    assert named, "the check below would check nothing"
    assert sorted((field, name) for field, name in named if name not in known) == []


def test_environment_values_are_parsed_by_the_field_type_not_its_description() -> None:
    """`TOKENFLOW_*` values are split as lists or read as JSON tables by the field's annotation text, which now
    carries its description: a description must not make a scalar look like a list or a table."""
    for field in msgspec.inspect.type_info(EngineConfig).fields:
        kind = field.type.type
        kinds = kind.types if isinstance(kind, msgspec.inspect.UnionType) else (kind,)
        annotation = str(EngineConfig.__annotations__[field.name])
        is_dict = any(isinstance(k, msgspec.inspect.DictType) for k in kinds)
        is_list = any(isinstance(k, msgspec.inspect.ListType) for k in kinds)
        assert ("dict[" in annotation) == is_dict, field.name
        assert ("list[" in annotation) == is_list, field.name
