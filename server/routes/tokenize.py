"""POST /tokenize and /detokenize, in vLLM's shapes: what a prompt costs in tokens, and the text of token ids;
GET /tokenizer_info, what a client needs to use these two as its tokenizer."""

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


@router.get("/tokenizer_info")
async def tokenizer_info(rt: Runtime = Depends(runtime), _owner: str | None = Depends(owner)) -> dict:
    """vLLM's: the tokenizer's configuration. lm-evaluation-harness's ``local-completions`` asks for it (and its
    ``eos_token``) to tokenize through /tokenize and /detokenize: a byte or word model has no Hugging Face
    tokenizer for it to load instead. No model here has an end-of-text or padding token (the word model's
    ``<eos>`` is a line's end), so those are null, as a tokenizer without them says."""
    tokenizer = rt.engine.tokenizer
    return {"tokenizer_class": type(tokenizer).__name__, "eos_token": None, "bos_token": None, "pad_token": None,
            "unk_token": getattr(tokenizer, "unk", None), "vocab_size": tokenizer.vocab_size,
            "model_max_length": rt.settings.max_prompt_bytes}
