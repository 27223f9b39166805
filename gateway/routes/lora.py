"""vLLM's runtime LoRA routes: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``.

The bodies are vLLM's (``lora_name``, ``lora_path``; ``lora_int_id`` is accepted and
ignored: Ferry's adapters are known by name). Loading asks a worker to check the adapter
and then registers it fleet-wide (``gateway/lora.py``); the answer is 200 with vLLM's
message, as JSON. They take the same API key as ``/v1`` (there is no admin key); a tenant
with a ``lora_adapters`` allowlist may load and unload only the names in it.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from gateway.admission import require_api_key
from gateway.body import parse_json, validate
from gateway.lora import LoraAdapters
from gateway.routes.openai import body_schema
from gateway.tenancy.principal import tenant

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


class LoadLoraBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


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
    record = await lora.load(body.lora_name, body.lora_path, tenant(http))
    return {"object": "lora_adapter", "id": record.name, "parent": record.parent,
            "root": record.path,
            "message": f"Success: LoRA adapter '{record.name}' added successfully."}


@router.post("/unload_lora_adapter", openapi_extra=body_schema(UnloadLoraBody))
async def unload_lora_adapter(http: Request, lora: LoraAdapters = Depends(get_lora)
                              ) -> dict[str, Any]:
    body = validate(UnloadLoraBody, parse_json(await http.body()))
    record = await lora.unload(body.lora_name, tenant(http))
    return {"object": "lora_adapter", "id": record.name, "parent": record.parent,
            "message": f"Success: LoRA adapter '{record.name}' removed successfully."}
