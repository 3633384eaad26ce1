"""/openapi.json comes from the pydantic models, whose fields are exactly the fields the router accepts."""

from __future__ import annotations

import pytest

from tandem.services.router.embeddings import _FIELDS as EMBEDDING_FIELDS
from tandem.services.router.openai_protocol import CHAT_FIELDS, COMPLETION_FIELDS
from tandem.services.router.schema import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, openapi_document


def field_names(model) -> set[str]:
    return {info.alias or name for name, info in model.model_fields.items()}


@pytest.mark.parametrize("model,accepted", [(CompletionRequest, COMPLETION_FIELDS), (ChatCompletionRequest, CHAT_FIELDS),
                                            (EmbeddingRequest, EMBEDDING_FIELDS)])
def test_the_documented_fields_are_the_accepted_ones(model, accepted):
    assert field_names(model) == accepted


def test_the_document_references_resolve_and_forbid_unknown_fields():
    doc = openapi_document()
    schemas = doc["components"]["schemas"]
    text = repr(doc)
    for name in ("CompletionRequest", "ChatCompletionRequest", "ErrorResponse", "Tool", "ChatMessage"):
        assert name in schemas and f"#/components/schemas/{name}" in text
    assert schemas["ChatCompletionRequest"]["additionalProperties"] is False
    assert doc["paths"]["/v1/models/{model}"]["get"]["parameters"][0]["name"] == "model"
