"""POST /tokenize and /detokenize, in vLLM's shapes: what a prompt costs in tokens, and the text of token ids."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from server.completion import check_model, prompt_ids
from server.deps import owner, runtime
from server.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from server.runtime import Runtime
from txlserve.errors import InvalidRequestError

router = APIRouter()


@router.post("/tokenize", response_model=TokenizeResponse, response_model_exclude_none=True)
async def tokenize(body: TokenizeRequest, rt: Runtime = Depends(runtime),
                   _owner: str | None = Depends(owner)) -> TokenizeResponse:
    if body.model is not None:
        check_model(rt, body.model)
    ids = await prompt_ids(rt, body.prompt, rt.settings.max_prompt_bytes)
    names = [rt.engine.tokenizer.token_name(t) for t in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=rt.settings.max_prompt_bytes, tokens=ids, token_strs=names)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, rt: Runtime = Depends(runtime),
                     _owner: str | None = Depends(owner)) -> DetokenizeResponse:
    if body.model is not None:
        check_model(rt, body.model)
    vocab = rt.engine.config.vocab_size
    if body.tokens and max(body.tokens) >= vocab:
        raise InvalidRequestError(f"token ids must be in 0..{vocab - 1}", param="tokens")
    return DetokenizeResponse(prompt=rt.engine.tokenizer.decode_bytes(body.tokens).decode("utf-8", "replace"))
