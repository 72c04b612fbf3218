"""verl's data.datagen.path / .name through the verl entry point: the generator class, made with the data.datagen
node, adds training rows after every step, which the next epoch trains on; a class written against verl's
AbstractDataGenerator is refused naming file, class and change."""

import pytest

import rlflow.config.verl.devices as devices
from rlflow.config import load_config, make_plan
from rlflow.config.verl.loading import ConfigError
from rlflow.registry import load_object
from rlflow.trainer.main_ppo import main

GENERATOR = '''
from rlflow.data.datagen import DataGenerator

SEEN = []


class RepeatFirst(DataGenerator):
    """One more copy of the first training row after every step."""

    def generate(self, rows):
        SEEN.append((len(rows), self.config["name"]))
        first = rows[0]
        return [{"prompt": first["prompt"], "ground_truth": first["ground_truth"], "data_source": first["data_source"],
                 "extra_info": {"copy_of": first["index"]}}]
'''
VERL_STYLE = '''
import datasets
from verl.experimental.dynamic_dataset.dynamicgen_dataset import AbstractDataGenerator


class Questions(AbstractDataGenerator):
    def generate(self, dataset) -> datasets.Dataset:
        return dataset.dataframe.select([0])
'''


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


def test_the_generator_adds_rows_that_the_next_epoch_trains_on(tiny, tmp_path):
    (tmp_path / "gen.py").write_text(GENERATOR)
    keys = [f"data.datagen.path={tmp_path}/gen.py", "data.datagen.name=RepeatFirst"]
    seen = load_object(str(tmp_path / "gen.py"), "SEEN", "test")
    assert main(tiny + keys + ["trainer.total_training_steps=4", "trainer.val_before_train=false",
                               "trainer.test_freq=-1"]) == 0
    # 12 training rows, 4 a step: epoch 0 is steps 1-3 (3 rows generated), step 4 is in epoch 1 over 15 rows
    assert seen == [(12, "RepeatFirst")] * 3 + [(15, "RepeatFirst")]


@pytest.mark.parametrize("source, name, message", [
    (VERL_STYLE, "Questions", r"data.datagen.path='.*gen.py': class Questions in .*gen.py is written against verl's "
     r"AbstractDataGenerator interface \(it subclasses verl's AbstractDataGenerator; its generate returns a "
     r"datasets.Dataset\).*Change it to subclass rlflow.data.datagen.DataGenerator"),
    (GENERATOR, "null", r"data.datagen.name=None: the class name"),
    ("class RepeatFirst:\n    pass\n", "RepeatFirst", r"not a subclass.*Change it to subclass rlflow.data.datagen"),
])
def test_what_the_datagen_keys_cannot_take_is_refused_naming_the_key(tiny, tmp_path, source, name, message):
    (tmp_path / "gen.py").write_text(source)
    with pytest.raises(ConfigError, match=message):
        make_plan(load_config(tiny + [f"data.datagen.path={tmp_path}/gen.py", f"data.datagen.name={name}"]))
