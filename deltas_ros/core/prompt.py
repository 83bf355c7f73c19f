"""Where the stream and a question sit in the chat template: one definition for the memory and
for training, so a trained model sees at inference exactly the layout it was trained on.

    <prefix: opens the user turn>  chunk 0  chunk 1 ...  <before> question <after: assistant turn>

The prefix tokens are the attention sinks; the question closes the user turn and opens the
assistant's, whose answer the model then writes. Qwen3.5's published template opens that turn
with a reasoning block (`<think>\n`) unless `enable_thinking` is passed as false, when it writes
an empty one (`<think>\n\n</think>\n\n`): the layout passes the flag, so a real checkpoint
answers at once unless thinking is asked for.
"""

from __future__ import annotations

import gc
import multiprocessing
import resource
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

VIDEO_MARKER = "<|vision_start|><|video_pad|><|vision_end|>"
QUESTION_MARKER = "{question}"
THINK_END = "</think>"  # closes the reasoning block; the answer follows it
# A chat template comes with the model directory and renders once, at configure, in a child
# process bounded in time and in memory it may add (a real template takes milliseconds).
RENDER_TIMEOUT_S = 10.0
RENDER_MEMORY_BYTES = 1 << 30


@dataclass(frozen=True)
class ChatLayout:
    """The stream's prefix and the text around a question, rendered by the tokenizer's template."""

    prefix: str
    before_question: str
    after_question: str

    @classmethod
    def from_tokenizer(cls, tokenizer, thinking: bool = False) -> ChatLayout:
        """Render one user turn holding a video and a question (`render_bounded`), and split
        it at both. thinking: the template's `enable_thinking` (a template without the rule
        ignores it). ValueError when the template does not render in time or fails."""
        rendered = render_bounded(lambda: tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "video"},
                                          {"type": "text", "text": QUESTION_MARKER}]}],
            tokenize=False, add_generation_prompt=True, enable_thinking=thinking,
        ))
        if rendered.count(VIDEO_MARKER) != 1 or rendered.count(QUESTION_MARKER) != 1:
            raise ValueError("the tokenizer's chat template does not place a video in a user turn")
        prefix, suffix = rendered.split(VIDEO_MARKER)
        before, after = suffix.split(QUESTION_MARKER)
        return cls(prefix, before, after)

    @property
    def opens_reasoning(self) -> bool:
        """Whether the assistant turn starts inside an open reasoning block."""
        return self.after_question.rfind("<think>") > self.after_question.rfind(THINK_END)

    def question_ids(self, tokenizer, question: str) -> list[int]:
        """Token ids closing the user turn with `question` and opening the answer.

        The question is tokenized with special tokens split, so a question cannot close the turn
        or inject template markup of its own.
        """
        encode = tokenizer.encode
        return (encode(self.before_question, add_special_tokens=False)
                + encode(question, add_special_tokens=False, split_special_tokens=True)
                + encode(self.after_question, add_special_tokens=False))


def render_bounded(render: Callable[[], str], timeout_s: float | None = None) -> str:
    """render() run in a forked child that is killed after timeout_s (RENDER_TIMEOUT_S) and
    may add at most RENDER_MEMORY_BYTES; ValueError with the reason when it does not finish.

    Why a process: jinja2's sandbox bounds neither loops nor output (a template looping
    99999 x 99999 times kept configure busy for good), and a thread cannot be stopped. Why a
    fork: the child has the loaded tokenizer and its libraries already, so nothing is imported
    or read again (milliseconds); it runs only the template, on objects no other thread uses
    during configure, so the locks a fork may copy held are not taken (and the time bound
    holds regardless)."""
    timeout_s = RENDER_TIMEOUT_S if timeout_s is None else timeout_s
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_render_child, args=(render, send), daemon=True)
    with warnings.catch_warnings():  # Python 3.12+: "multi-threaded, fork() may deadlock"
        warnings.simplefilter("ignore", DeprecationWarning)
        child.start()
    send.close()
    try:
        if not receive.poll(timeout_s):
            raise ValueError(f"the chat template did not render within {timeout_s:g} s "
                             "(an endless or huge loop?): refused")
        try:
            ok, value = receive.recv()
        except EOFError:
            raise ValueError("the chat template's render ended without a result") from None
    finally:
        child.kill()
        child.join()
        receive.close()
    if not ok:
        raise ValueError(f"the chat template does not render: {value}")
    return value


def _render_child(render: Callable[[], str], send: Connection) -> None:
    """In the child: bound the memory it may add, render, send (ok, text or the error).

    The garbage collector is off first: a collection here would finalize objects inherited
    from the parent (a memory, a tier writer's state), copied in whatever state the parent's
    other threads had them in at the fork, and such a collection once killed the child."""
    gc.disable()
    with open("/proc/self/statm") as statm:  # size in pages, then resident
        size = int(statm.read().split()[0]) * resource.getpagesize()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + RENDER_MEMORY_BYTES
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        result = (True, render())
    except Exception as error:  # a template's own error, MemoryError: reported, not raised
        result = (False, f"{type(error).__name__}: {error}")
    send.send(result)
