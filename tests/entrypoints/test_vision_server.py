"""Images through `pagoda serve` on the tiny Gemma 3 vision model: the official openai client's
chat with an image as a data: URL (and a file:// URL under --allowed-local-media-path) answers
transformers' greedy tokens, counts the image's tokens in usage and hits the prefix cache on a
repeated image; Ollama's `images` and gRPC's `ChatMessage.images` take the same path; bad images (corrupt, not an image, too many
pixels, too many, a remote URL, a file outside the allowed directory) are 400s that name the
part, and the server goes on serving."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
from vision_models import chat_text, hf_greedy, make_tiny_gemma3_vision, random_image, reference

from pagoda.client import EngineClient
from tests.server_process import _free_port, start_server, stop_process

MAX_TOKENS = 6


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_gemma3_vision(tmp_path_factory.mktemp("vision-server") / "m", seed=7)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "cat.png").write_bytes(_png(random_image(21, (64, 48))))
    return root


GRPC_PORT = _free_port()


@pytest.fixture(scope="module")
def server(model_dir, media_dir):
    proc, base = start_server(model_dir, "--limit-mm-per-prompt", '{"image": 2}', "--max-image-pixels", "40000",
                              "--allowed-local-media-path", str(media_dir), "--block-size", "8",
                              "--grpc-port", str(GRPC_PORT), "--engine-process")  # images pickled to the engine
    yield base
    stop_process(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def hf(model_dir):
    return reference(model_dir)


TEXT = "Paris is the capital of France. Describe"


def _chat(client, parts: list[dict]):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}],
                                          max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})


def _expected(hf, images) -> tuple[list[int], str]:
    ref, processor = hf
    text = chat_text(processor, [{"type": "text", "text": TEXT}] + [{"type": "image"}] * len(images))
    ids, tokens, _ = hf_greedy(ref, processor, text, images, MAX_TOKENS)
    return ids, processor.tokenizer.decode(tokens, skip_special_tokens=True)


def test_chat_with_a_data_url_answers_as_transformers(client, hf):
    image = random_image(20, (50, 70))
    ids, text = _expected(hf, [image])
    parts = [{"type": "text", "text": TEXT}, {"type": "image_url", "image_url": {"url": _data_url(_png(image))}}]
    first = _chat(client, parts)
    assert first.choices[0].message.content == text
    assert first.usage.prompt_tokens == len(ids)  # the image's tokens counted
    again = _chat(client, parts)  # the same image: its blocks come from the prefix cache
    assert again.choices[0].message.content == text
    image_at = ids.index(hf[1].tokenizer.image_token_id)
    assert again.usage.prompt_tokens_details.cached_tokens > image_at
    other = random_image(22, (50, 70))
    _, other_text = _expected(hf, [other])
    parts[1] = {"type": "image_url", "image_url": {"url": _data_url(_png(other))}}
    changed = _chat(client, parts)  # the same placeholders, another image: no hit through it
    assert changed.choices[0].message.content == other_text
    assert (changed.usage.prompt_tokens_details.cached_tokens or 0) <= image_at
    tokens = httpx.post(f"{client.base_url}".removesuffix("/v1/") + "/tokenize",
                        json={"model": "tiny", "messages": [{"role": "user", "content": parts}]}, timeout=30).json()
    assert tokens["tokens"] == ids and tokens["count"] == first.usage.prompt_tokens  # /tokenize takes images too


def test_responses_api_input_image(client, hf):
    """The Responses API's input_image parts answer as chat's image_url parts do; a turn that
    continues the response (previous_response_id) carries the image in its history."""
    image = random_image(31, (48, 40))
    url = _data_url(_png(image))
    first = client.responses.create(model="tiny", max_output_tokens=MAX_TOKENS, temperature=0.0,
                                    extra_body={"ignore_eos": True},
                                    input=[{"role": "user", "content": [{"type": "input_text", "text": TEXT},
                                                                        {"type": "input_image", "image_url": url}]}])
    assert first.output_text == _expected(hf, [image])[1]
    assert first.usage.input_tokens == len(_expected(hf, [image])[0])
    again = client.responses.create(model="tiny", max_output_tokens=2, previous_response_id=first.id,
                                    input="And more?", extra_body={"ignore_eos": True})
    assert again.output_text and again.usage.input_tokens > first.usage.input_tokens  # (cut at max_output_tokens)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", max_output_tokens=2, input=[{"role": "user", "content": [
            {"type": "input_image", "file_id": "file-abc"}]}])
    assert "file_id is not supported" in e.value.body["message"]


def test_a_local_file_under_the_allowed_directory(client, hf, media_dir):
    from PIL import Image

    _, text = _expected(hf, [Image.open(media_dir / "cat.png")])
    out = _chat(client, [{"type": "text", "text": TEXT},
                         {"type": "image_url", "image_url": {"url": (media_dir / "cat.png").as_uri()}}])
    assert out.choices[0].message.content == text


def _images_first(hf, image) -> str:
    """transformers' answer to TEXT with ``image`` before it (as Ollama and gRPC place a message's images)."""
    ref, processor = hf
    prompt = chat_text(processor, [{"type": "image"}, {"type": "text", "text": TEXT}])
    _, tokens, _ = hf_greedy(ref, processor, prompt, [image], MAX_TOKENS)
    return processor.tokenizer.decode(tokens, skip_special_tokens=True)


def test_anthropic_image_blocks(server, hf):
    import anthropic

    image = random_image(29, (44, 33))
    client = anthropic.Anthropic(base_url=server, api_key="none", max_retries=0)
    out = client.messages.create(model="tiny", max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True, "temperature": 0.0},
                                 messages=[{"role": "user", "content": [
                                     {"type": "text", "text": TEXT},
                                     {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": base64.b64encode(_png(image)).decode()}}]}])
    assert out.content[0].text == _expected(hf, [image])[1]


def test_grpc_images(server, hf):
    import grpc

    image = random_image(27, (33, 44))
    with EngineClient(f"127.0.0.1:{GRPC_PORT}", timeout=60) as client:
        pieces = list(client.chat([{"role": "user", "content": TEXT, "images": [_png(image)]}], max_tokens=MAX_TOKENS,
                                  temperature=0, ignore_eos=True))
        with pytest.raises(grpc.RpcError) as e:
            list(client.chat([{"role": "user", "content": TEXT, "images": [b"not an image"]}], max_tokens=2))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not an image" in e.value.details()
    assert "".join(p.text for p in pieces) == _images_first(hf, image)


def test_ollama_images(server, hf):
    image = random_image(23, (30, 30))
    body = {"model": "tiny", "stream": False, "options": {"temperature": 0, "num_predict": MAX_TOKENS},
            "messages": [{"role": "user", "content": TEXT, "images": [base64.b64encode(_png(image)).decode()]}]}
    r = httpx.post(f"{server}/api/chat", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["message"]["content"] == _images_first(hf, image)
    generate = {"model": "tiny", "stream": False, "prompt": TEXT, "images": body["messages"][0]["images"],
                "options": body["options"]}
    r = httpx.post(f"{server}/api/generate", json=generate, timeout=60)
    assert r.status_code == 200 and r.json()["response"] == _images_first(hf, image), r.text
    bad = {**body, "messages": [{"role": "user", "content": TEXT, "images": ["bm90IGFuIGltYWdl"]}]}
    r = httpx.post(f"{server}/api/chat", json=bad, timeout=60)
    assert r.status_code == 400 and "messages.0.images.0" in r.json()["error"]


@pytest.mark.parametrize("url, says", [
    (_data_url(_png(random_image(26, (40, 40)))[:120]), "corrupt"),  # a PNG cut short
    (_data_url(b"just some text, not an image"), "not an image"),
    (_data_url(b"hello", "text/plain"), "not an image"),
    ("data:image/png;base64,%%%", "base64"),
    (_data_url(_png(random_image(24, (300, 200)))), "pixels"),  # 60 000 > --max-image-pixels 40 000
    ("http://127.0.0.1:9/secret.png", "allowed-media-domains"),  # never fetched
    ("file:///etc/hostname", "outside the allowed media directory"),
], ids=["corrupt", "not-an-image", "wrong-type", "bad-base64", "too-many-pixels", "remote", "outside"])
def test_bad_images_are_400s_naming_the_part(client, url, says):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, [{"type": "text", "text": TEXT}, {"type": "image_url", "image_url": {"url": url}}])
    error = e.value.body
    assert says in error["message"] and error["param"] == "messages.0.content.1.image_url"
    assert _chat(client, [{"type": "text", "text": TEXT}]).choices[0].finish_reason == "length"  # still serving


def test_image_tokens_without_an_image_are_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, [{"type": "text", "text": "look: <image_soft_token>"}])
    assert "image tokens" in e.value.body["message"] and "no images" in e.value.body["message"]


def test_more_images_than_the_limit_is_a_400(client):
    part = {"type": "image_url", "image_url": {"url": _data_url(_png(random_image(25)))}}
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, [{"type": "text", "text": TEXT}, part, part, part])
    assert "limit-mm-per-prompt" in e.value.body["message"]


def test_what_does_not_take_images_says_so(server, client):
    """A session's stored history and beam search's token-id beams take no images: a 400 each."""
    part = {"type": "image_url", "image_url": {"url": _data_url(_png(random_image(28)))}}
    r = httpx.post(f"{server}/v1/sessions", json={"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "text", "text": TEXT}, part]}]}, timeout=30)
    assert r.status_code == 400 and "session" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [part]}], max_tokens=2,
                                       extra_body={"use_beam_search": True, "best_of": 2, "n": 1})
    assert "beam search does not take images" in e.value.body["message"]
