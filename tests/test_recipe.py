import pytest

from poise_trl.algorithms import get_algorithm
from poise_trl.run.recipe import (
    RecipeError,
    check_batch_geometry,
    load_recipe,
    parse_override,
    parse_recipe,
    split_recipe,
)


def write(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


def test_overrides_are_yaml_typed_and_nested(tmp_path):
    recipe = load_recipe(write(tmp_path, "algo: grpo\nlearning_rate: 1.0e-6\n"),
                         ["learning_rate=3e-4", "max_steps=7", "peft.r=4", "rewards=[math_accuracy, format]",
                          "bf16=false"])
    assert recipe["learning_rate"] == 3e-4 and recipe["max_steps"] == 7
    assert recipe["peft"] == {"r": 4}
    assert recipe["rewards"] == ["math_accuracy", "format"]
    assert recipe["bf16"] is False


@pytest.mark.parametrize("bad", ["max_steps", "=3"])
def test_malformed_override(bad):
    with pytest.raises(RecipeError, match="key=value|empty key"):
        parse_override(bad)


def test_missing_recipe_file(tmp_path):
    with pytest.raises(RecipeError, match="not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_recipe_must_be_a_mapping(tmp_path):
    with pytest.raises(RecipeError, match="mapping"):
        load_recipe(write(tmp_path, "- a\n- b\n"))


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(RecipeError, match="did you mean 'learning_rate'"):
        split_recipe({"algo": "grpo", "learnin_rate": 1e-5}, get_algorithm("grpo"))


def test_split_separates_run_settings_from_config():
    settings, config = split_recipe({"algo": "poise", "dataset": "aime25", "probe_layer": 0.5, "beta": 0.0},
                                    get_algorithm("poise"))
    assert settings.dataset == "aime25" and settings.algo == "poise"
    assert config == {"probe_layer": 0.5, "beta": 0.0}


def test_unknown_algo_suggests():
    with pytest.raises(ValueError, match="did you mean 'poise'"):
        get_algorithm("poisee")


def test_batch_not_divisible_by_num_generations_names_the_fix():
    with pytest.raises(RecipeError, match=r"not divisible by num_generations=4.*multiple of 4"):
        check_batch_geometry({"num_generations": 4, "per_device_train_batch_size": 6})


def test_algo_defaults_apply_and_recipe_wins(tmp_path):
    config = parse_recipe({"algo": "poise", "epsilon_high": 0.3}, str(tmp_path)).args
    assert config.num_generations == 2 and config.epsilon_high == 0.3 and config.beta == 0.0
    assert config.use_cpu and not config.bf16


def test_push_to_hub_is_a_run_setting_and_needs_a_repo(tmp_path):
    from poise_trl.run.train import train_from_recipe

    settings, config = split_recipe({"algo": "grpo", "push_to_hub": True, "hub_model_id": "me/x"},
                                    get_algorithm("grpo"))
    assert settings.push_to_hub is True and "push_to_hub" not in config  # TRL's own push stays off
    with pytest.raises(RecipeError, match="hub_model_id"):
        train_from_recipe({"algo": "grpo", "push_to_hub": True}, output_dir=str(tmp_path), show_progress=False)
