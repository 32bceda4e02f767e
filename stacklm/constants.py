"""Values shared by layers that may not import each other, defined once here, below them all.

``IGNORE_INDEX``: the target value that takes no loss (torch's ``cross_entropy`` default).
``stacklm.chat`` makes SFT targets with it, ``stacklm.data`` pre-training ones (the batch
contract, ``data/contract.py``, names it), the trainer reads it; the chat wing sits below
``data/``, so the constant cannot live in ``data/``.

``KEPT``: the stage-statistics reason of an item that went through a stage unchanged. The SFT
renderer (``stacklm.chat.render``) returns it for a conversation that fit, and every ``data/``
stage counts it (``data/audit.py`` names it with the other reasons).

``MALFORMED_JSON``: the reason of a JSON-lines row that does not parse, counted by the
pre-training sources (``data/audit.py``'s invalid records) and by the SFT readers (a
conversation's ``ChatFormatError``, ``stacklm.chat.turns``) under the same name.
"""

IGNORE_INDEX = -100
KEPT = "kept"
MALFORMED_JSON = "malformed_json"
