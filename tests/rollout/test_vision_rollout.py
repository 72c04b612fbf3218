"""The engine contract for images: per-prompt MultiModalPrompt next to the token ids; engines that do not
take images are refused clearly."""

import pytest

from rlflow.data import keys as K
from rlflow.rollout.engines import Completion, Engine
from rlflow.rollout.single_turn import SingleTurnRollout, multi_modal_prompts
from tests.vlm import batch, tiny_vlm


class TextOnly(Engine):
    def generate(self, prompts, params, multi_modal=None):
        return [[Completion([2], [0.0], "stop")] * params.n for _ in prompts]


class Recording(TextOnly):
    accepts_images = True

    def generate(self, prompts, params, multi_modal=None):
        self.seen = multi_modal
        return super().generate(prompts, params)


@pytest.fixture(scope="module")
def vision_batch():
    _, processor = tiny_vlm("qwen2_5_vl")
    return processor, batch(processor)


def test_each_prompt_gets_its_images_in_both_forms(vision_batch):
    processor, prompts = vision_batch
    engine = Recording()
    rollout = SingleTurnRollout(engine, n=2, max_new_tokens=2)
    rollout.bind(None, processor.tokenizer)
    out = rollout(prompts)
    seen = engine.seen
    assert [type(m).__name__ if m else None for m in seen] == ["MultiModalPrompt"] * 2 + [None, "MultiModalPrompt"]
    assert [len(m.images) for m in seen if m] == [1, 2, 1] and seen[1].images[1].size == (84, 112)
    assert seen[1].inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 8, 6]]
    assert out.batch_size[0] == 8 and list(out[K.MULTI_MODAL_INPUTS])[2] is list(out[K.MULTI_MODAL_INPUTS])[3]


def test_an_engine_without_images_is_refused(vision_batch):
    processor, prompts = vision_batch
    rollout = SingleTurnRollout(TextOnly(), n=1, max_new_tokens=2)
    rollout.bind(None, processor.tokenizer)
    with pytest.raises(TypeError, match="TextOnly does not take images"):
        rollout(prompts)
    text_rows = prompts[2:3]  # a text-only row of a vision batch needs no image support
    assert multi_modal_prompts(text_rows) is None
    assert rollout(text_rows).batch_size[0] == 1



def test_the_vllm_and_server_engines_refuse_images_clearly(vision_batch, tmp_path):
    """Neither takes images yet (vLLM's multimodal path needs transformers' AutoProcessor, which needs
    torchvision for Qwen2-VL): a VLM folder is refused before vLLM starts, images before a request is sent."""
    from rlflow.models.tiny_vlm import save_model_folder
    from rlflow.rollout.engines.server import ServerEngine
    from rlflow.rollout.engines.vllm import VLLMEngine

    processor, prompts = vision_batch
    save_model_folder(tiny_vlm("qwen2_5_vl")[0], processor, tmp_path)
    with pytest.raises(NotImplementedError, match="vision-language model; rlflow's vLLM engine takes no images"):
        VLLMEngine(tmp_path)
    server = ServerEngine("http://127.0.0.1:9", model="never-contacted", retries=0)
    try:
        rollout = SingleTurnRollout(server, n=1, max_new_tokens=2)
        rollout.tokenizer = processor.tokenizer
        with pytest.raises(TypeError, match="ServerEngine does not take images .* HFRollout"):
            rollout(prompts)
    finally:
        server.close()
