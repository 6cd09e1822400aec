"""pagoda.dialogue: a layered dialogue system on `pagoda.lang`.

- Dialogue layer: a `TopicStack` of `Topic` frames (push, pop, resume an interrupted topic with
  its slots intact) and entity `Slot`s typed by JSON schema (validated with jsonschema).
- Inference layer, each turn: NLU (a `select` over the intents; per slot a `select` over the
  spans of the current message that fit it, or none), DM (a policy written as code,
  `(state, nlu) -> Action`, or as a `StateTable`), NLG (templates, or free generation).
- Each turn is one program run on the session's transcript, with the session's id: the engine
  keeps the conversation's prefix pinned in its prefix cache, so a turn computes only its new
  tokens instead of the whole history.

    booking = Topic("booking", intents=["booking"], slots=[Slot("party_size", {"type": "integer"}, "How many?")])
    app = Dialogue(lang.Engine("smollm2"), topics=[booking], intents={"booking": [...], ...},
                   policy=StateTable({("booking", "missing"): ask(), ...}))
    session = app.session()
    turn = session.say("A table for four, please.")
    turn.reply, turn.intent, session.stack.current.values, turn.computed_tokens

See examples/restaurant_booking.py.
"""

from pagoda.dialogue.nlu import NLU, Understanding
from pagoda.dialogue.policy import Action, DialogueState, StateTable, answer, ask, complete, say
from pagoda.dialogue.dialogue_session import Dialogue, DialogueSession, Turn, Usage
from pagoda.dialogue.slots import Candidate, Slot
from pagoda.dialogue.topics import Frame, Topic, TopicStack

__all__ = [
    "NLU", "Action", "Candidate", "Dialogue", "DialogueSession", "DialogueState", "Frame", "Slot", "StateTable",
    "Topic", "TopicStack", "Turn", "Understanding", "Usage", "answer", "ask", "complete", "say",
]
