"""Anthropic's Messages API: the request converted to chat as vLLM converts it (``common.messages``) and planned
like a chat (the system prompt and tool definitions kept whole, fresh / extend / whole, warming). Backends that
render requests themselves get the client's own body at their ``/v1/messages`` with the swap; the others get
the chat path, and its answers come back as Messages answers and events."""

from __future__ import annotations

from common.messages import Conversation, MessagesRequest, chat_to_message, merges_inline_system, message_events
from gateway.entrypoints import answers
from gateway.entrypoints.chat import ChatAPI
from gateway.entrypoints.surface import Surface
from gateway.serving import MESSAGES, Answer, GatewayServing


class MessagesAPI(Surface):
    rewrite = staticmethod(answers.anthropic)
    ping = True

    def __init__(self, serving: GatewayServing, chat: ChatAPI) -> None:
        super().__init__(serving)
        self.chat = chat
        self.merge_inline_system = merges_inline_system(serving.tokenizer)  # as vLLM decides it for the template

    async def answer(self, request: MessagesRequest, headers) -> Answer:
        serving, model = self.serving, self.serving.model_name
        chat = request.as_chat(self.merge_inline_system)
        chat.specprefill = request.specprefill
        if not serving.swaps:
            answer = await self.chat.answer(chat, headers)
            return answer.map(lambda body: chat_to_message(body, model), lambda stream: message_events(stream, model))
        plan, _ = await serving.planned(chat, headers)
        return await serving.swapped(plan, await serving.backend_body(request), MESSAGES)

    def count_tokens(self, request: Conversation) -> int:
        """The prompt's tokens, with the target's tokenizer and chat template."""
        self.serving.check_model(request.model)
        return len(self.serving.prompt(request.as_chat(self.merge_inline_system)).token_ids)
