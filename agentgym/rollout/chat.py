"""Turning messages into token ids, once, the way the generation manager appends them.

* The prompt is the chat template of the reset messages with the generation prompt.
* ``inline`` observations (Search-R1, ReTool) are the message text, tokenized alone and
  appended to the assistant's running text.
* ``chat`` observations are new messages rendered through the chat template: we render a
  fixed base conversation with and without the new messages and tokenize the suffix.
  Before it, "filler" closes the assistant turn with whatever the template writes after
  assistant content (``<|im_end|>\\n`` for ChatML) that the model did not itself sample.

Tokens the model generated are never decoded and re-encoded: the token stream is built by
appending, so the trainer sees exactly the ids the engine sampled.
"""

from __future__ import annotations

from typing import Any

_PROBE_USER = "\x00agentgym-probe-user\x00"
_PROBE_ASSISTANT = "\x00agentgym-probe-assistant\x00"


class ChatTokens:
    """Chat-template arithmetic for one tokenizer."""

    def __init__(self, tokenizer, image_processor: Any = "auto") -> None:
        self.tok = tokenizer
        if image_processor == "auto":  # the one saved with the model, for VL models
            from agentgym.models.vision import load_image_processor  # lazy: loads torch
            path = getattr(tokenizer, "name_or_path", "") or ""
            image_processor = load_image_processor(path) if path else None
        self.image_processor = image_processor
        self._base = [{"role": "user", "content": _PROBE_USER},
                      {"role": "assistant", "content": _PROBE_ASSISTANT}]
        base_text = self._render(self._base)
        at = base_text.rfind(_PROBE_ASSISTANT)
        if at < 0:
            raise ValueError("the tokenizer's chat template drops assistant content; "
                             "chat-format observations need a template that keeps it")
        self._base_text = base_text
        #: Text the template writes after assistant content, e.g. "<|im_end|>\n".
        self.assistant_close = base_text[at + len(_PROBE_ASSISTANT):]

    def _render(self, messages: list[dict], add_generation_prompt: bool = False,
                tools: list[dict] | None = None) -> str:
        kw = {"tools": tools} if tools else {}
        return self.tok.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=add_generation_prompt, **kw)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template renders ``tools=`` (else they go in a system message,
        :func:`agentgym.envs.function_calling.fallback_system_message`)."""
        if not hasattr(self, "_renders_tools"):
            from agentgym.envs.function_calling import function_tool  # lazy: imports the envs
            probe = [function_tool("agentgym_probe", "probe", {"x": {"type": "string"}})]
            base = [{"role": "user", "content": _PROBE_USER}]
            self._renders_tools = self._render(base, True, probe) != self._render(base, True)
        return self._renders_tools

    def with_tools(self, messages: list[dict], tools: list[dict] | None):
        """``(messages, tools)`` to render: as given when the template renders tools; else
        the tools moved into the system message (merged with one already there)."""
        if not tools or self.renders_tools:
            return messages, tools or None
        from agentgym.envs.function_calling import fallback_system_message  # lazy: imports the envs
        if messages and messages[0].get("role") == "system" and \
                isinstance(messages[0].get("content"), str):
            return [fallback_system_message(tools, messages[0]["content"]), *messages[1:]], None
        return [fallback_system_message(tools), *messages], None

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Ids of the conversation so far plus the assistant generation prompt; ``tools``
        (OpenAI function schemas) rendered by the template or in the system message."""
        messages, tools = self.with_tools(messages, tools)
        return self.encode(self._render(messages, add_generation_prompt=True, tools=tools))

    def prompt(self, messages: list[dict], tools: list[dict] | None = None):
        """``(ids, vision)``: :meth:`prompt_ids` with each image placeholder expanded to
        its image's tokens, and the processed images (:class:`agentgym.models.vision.VisionInputs`;
        None without images or for a text-only model, whose template drops them)."""
        ids = self.prompt_ids(messages, tools)
        pictures = _images(messages)
        if pictures and self.image_processor is None \
                and "<|image_pad|>" in self.tok.get_vocab():
            raise ValueError(f"the model at {self.tok.name_or_path} has image tokens but no "
                             "image processor (preprocessor_config.json) in its folder; "
                             "its images would be dropped")
        if not pictures or self.image_processor is None:
            return ids, None
        from agentgym.models.vision import (IMAGE_PAD, encode_images, expand_image_tokens,
                                     image_token_counts)  # lazy: loads torch
        vision = encode_images(self.image_processor, pictures)
        counts = image_token_counts(vision, self.image_processor.merge_size)
        return expand_image_tokens(ids, self.tok.convert_tokens_to_ids(IMAGE_PAD), counts), vision

    def observation_ids(self, messages: list[dict], fmt: str) -> list[int]:
        """Ids of an observation, appended after the assistant's sampled tokens."""
        if self.image_processor is not None and _images(messages):
            raise ValueError("images in observations after the first prompt are not "
                             "supported yet; put the image in the reset observation")
        if fmt == "inline":
            return self.encode("".join(_text(m["content"]) for m in messages))
        if fmt == "chat":
            full = self._render(self._base + list(messages), add_generation_prompt=True)
            if not full.startswith(self._base_text):
                raise ValueError("chat template re-renders earlier turns when messages are "
                                 "added; cannot append observations incrementally")
            return self.encode(full[len(self._base_text):])
        raise ValueError(f"observation_format {fmt!r} is not 'inline' or 'chat'")

    def action_ids(self, text: str, stop_strings: tuple[str, ...] = ()) -> list[int]:
        """Ids of an assistant action written as text (a demonstration), as a policy would
        sample them: the text, then EOS unless the text ends with one of the env's stop
        strings (generation stops there without an EOS)."""
        ids = self.encode(text)
        if not (stop_strings and text.endswith(tuple(stop_strings))):
            ids.append(self.tok.eos_token_id)
        return ids

    def after_action_ids(self, action_ids: list[int], observation: list[dict],
                         fmt: str) -> tuple[list[int], list[int]]:
        """``(filler, observation)`` ids that follow an assistant action: the one rule used
        by rollouts and by SFT, so both build the same token stream and loss mask."""
        sampled_eos = bool(action_ids) and action_ids[-1] == self.tok.eos_token_id
        filler = self.close_ids(sampled_eos) if fmt == "chat" else []
        return filler, self.observation_ids(observation, fmt)

    def close_ids(self, sampled_eos: bool) -> list[int]:
        """Filler that closes an assistant turn: the template's closing text minus the
        EOS the model sampled itself (if it stopped at a stop string, all of it)."""
        eos = self.tok.eos_token or ""
        close = self.assistant_close
        if sampled_eos and eos and close.startswith(eos):
            close = close[len(eos):]
        return self.encode(close)


def _images(messages: list[dict]) -> list:
    """The image parts' images, in order."""
    return [p["image"] for m in messages if not isinstance(m.get("content"), str)
            for p in (m.get("content") or []) if isinstance(p, dict) and p.get("type") == "image"]


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")
