"""vLLM's runtime LoRA routes: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``.

The bodies are vLLM's (``lora_name``, ``lora_path``, ``load_inplace``; ``lora_int_id`` is
accepted and ignored: Ferry's adapters are known by name). Loading asks a worker to check
the adapter and then registers it (``gateway/served/lora.py``); the answer is 200 with vLLM's
message, as JSON, and never the path. A tenant's key loads into and unloads from its own
namespace; an operator's (``FERRY_ADMIN_KEYS``, an ``admin`` tenant, or anyone on a gateway
without keys) registers fleet-wide adapters and may unload any
(``gateway/tenancy/operators.py``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from gateway.body import parse_json, validate
from gateway.routes.openai import body_schema
from gateway.served.lora import LoraAdapters
from gateway.tenancy.operators import lora_caller, require_lora_key
from protocol.lora.paths import MAX_PATH_CHARS

router = APIRouter(prefix="/v1", dependencies=[Depends(require_lora_key)])


class LoadLoraBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=MAX_PATH_CHARS)
    load_inplace: bool = False  # vLLM's: replace an adapter of this name (new weights)


class UnloadLoraBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's; ignored


def get_lora(request: Request) -> LoraAdapters:
    lora: LoraAdapters = request.app.state.lora
    return lora


@router.post("/load_lora_adapter", openapi_extra=body_schema(LoadLoraBody))
async def load_lora_adapter(http: Request, lora: LoraAdapters = Depends(get_lora)
                            ) -> dict[str, Any]:
    body = validate(LoadLoraBody, parse_json(await http.body()))
    loaded = await lora.load(body.lora_name, body.lora_path, lora_caller(http),
                             replace=body.load_inplace)
    return {"object": "lora_adapter", "id": loaded.name, "parent": loaded.record.parent,
            "message": f"Success: LoRA adapter '{loaded.name}' added successfully."}


@router.post("/unload_lora_adapter", openapi_extra=body_schema(UnloadLoraBody))
async def unload_lora_adapter(http: Request, lora: LoraAdapters = Depends(get_lora)
                              ) -> dict[str, Any]:
    body = validate(UnloadLoraBody, parse_json(await http.body()))
    loaded = await lora.unload(body.lora_name, lora_caller(http))
    return {"object": "lora_adapter", "id": loaded.name, "parent": loaded.record.parent,
            "message": f"Success: LoRA adapter '{loaded.name}' removed successfully."}
