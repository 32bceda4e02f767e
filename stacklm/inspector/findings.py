"""What ``stacklm inspect`` reports: the named checks, one finding of a check, and the error
for input it cannot read at all."""

from __future__ import annotations

from dataclasses import dataclass


ERROR, WARNING, INFO = "error", "warning", "info"

# The named checks, in report order.
CHECKS: dict[str, str] = {
    "invalid_conversation": "rows the SFT pipes drop (malformed JSON, unknown role, empty message, no assistant turn, "
                            "first turn not a user turn; chat.validate_conversation)",
    "roles_out_of_order": "conversations the SFT pipes train but flag: a system message after the start, ending on a "
                          "user/system turn, two user or two assistant turns in a row",
    "foreign_template": "role markers of another chat-template family inside content or text",
    "special_string_in_text": "special-token strings in untrusted text (must stay bytes)",
    "template_mismatch": "the tokenizer's chat template renders other ids/mask than stacklm's render_conversation",
    "assistant_turn_not_closed": "an assistant turn not closed by end-of-turn/EOS",
    "missing_eos": "a sequence or conversation without EOS",
    "cross_conversation_attention": "packed rows whose attention segments span two conversations",
    "positions_not_reset": "position ids that do not restart at 0 for each conversation",
    "targets_not_shifted": "targets that are not the next token (labels = input_ids in a shifted contract)",
    "loss_on_non_assistant": "loss-bearing targets on system/user/tool/marker tokens",
    "no_assistant_loss": "conversations whose assistant tokens carry no loss (all-zero assistant mask)",
    "turn_closer_not_trained": "a trained turn whose closing <|end|> carries no loss: the model never learns to end a turn",
    "ids_out_of_range": "token ids outside the tokenizer's vocabulary (data built with another tokenizer)",
    "padding_fraction": "the share of batch positions that are padding (warned when most of a batch is)",
    "stop_token_never_trained": "no end-of-turn/EOS token is a trained target anywhere: the model never learns to stop",
    "row_ends_mid_assistant": "a row that ends inside an assistant turn, before its stop token (a cut reply)",
    "truncation": "conversations cut or dropped for length (--seq-len), rows starting or ending inside one",
}


@dataclass
class Finding:
    """One occurrence. ``key`` groups occurrences into one reported message (default: the
    message itself); the report prints each group once, with its count and first locations."""

    check: str
    severity: str
    message: str
    where: str = ""
    key: str = ""

    def group_key(self) -> tuple[str, str, str]:
        return (self.check, self.severity, self.key or self.message)

    def to_dict(self) -> dict[str, str]:
        return {"check": self.check, "severity": self.severity, "message": self.message, "where": self.where}


