"""The /v1/completions body: its prompt (a string, token ids, or a list of either), logprobs;
echo, suffix and best_of other than n are refused."""

from __future__ import annotations

from edgellm.server.errors import bad_request
from edgellm.server.protocol import SamplingRequest


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def _num_logprobs(self) -> int | None:
        return self.logprobs

    def check(self) -> None:
        super().check()
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad_request("logprobs must be between 0 and 20", param="logprobs")
        if self.echo:
            raise bad_request(
                "echo is not supported by this server", param="echo", code="unsupported"
            )
        if self.suffix:
            raise bad_request(
                "suffix is not supported by this server", param="suffix", code="unsupported"
            )
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported (it must equal n)", param="best_of")
        if isinstance(self.prompt, list) and not self.prompt:
            raise bad_request("prompt must not be an empty list", param="prompt")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        # validated as one of the list forms, so a list holds only ids, only strings or only lists
        ids = [x for x in p if isinstance(x, int)]
        if len(ids) == len(p):
            return [ids]
        return [x for x in p if not isinstance(x, int)]
