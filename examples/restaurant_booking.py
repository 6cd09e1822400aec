"""A restaurant-booking assistant on pagoda.dialogue: it books a table (party size, day, time,
name), answers questions in between (a digression), and goes back to the booking where it was.

    python examples/restaurant_booking.py                  # the scripted 12-turn conversation
    python examples/restaurant_booking.py --interactive    # talk to it yourself
    python examples/restaurant_booking.py --naive          # the same script, whole history recomputed every turn

Each turn runs as one pagoda.lang program on the session's transcript, so the prefix cache serves
the conversation so far and a turn computes only its own new tokens; `--naive` turns the prefix
cache off (the history is recomputed in every prompt), which is what the per-turn numbers
printed at the end compare. benchmarks/dialogue_turns.py plots both.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from pagoda import lang
from pagoda.dialogue import Dialogue, Slot, StateTable, Topic, answer, ask, complete, say

DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]

SLOTS = [
    Slot("party_size", {"type": "integer", "minimum": 1, "maximum": 20}, "How many people will be dining?",
         instruction="How many people is the table for? Answer none if the message does not say.",
         examples=[("I want to book a table for 2 people.", "2"), ("There will be six of us.", "six"),
                   ("Tuesday at 18:00, 3 of us.", "3"), ("Saturday at 19:00 please.", None),
                   ("It's for 12 guests.", "12"), ("Is table 7 free?", None), ("Change it to eight people.", "eight"),
                   ("We are two adults.", "two")]),
    Slot("day", {"type": "string", "enum": DAYS}, "Which day would you like to come?",
         instruction="Which day of the week is the booking for? Answer none if the message does not say.",
         examples=[("Tuesday please.", "Tuesday"), ("A table for 2 on Sunday.", "Sunday"), ("At 18:00.", None),
                   ("Let's do Saturday at 19:00.", "Saturday"), ("Could we come on monday?", "monday")]),
    Slot("time", {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"},
         "What time would you like the table? For example 19:30.",
         instruction="At what time is the booking? Answer none if the message does not say.",
         examples=[("At 18:00.", "18:00"), ("Sunday at 20:15 for 3.", "20:15"), ("Tuesday please.", None),
                   ("Make it 12:30 instead.", "12:30")]),
    Slot("name", {"type": "string", "minLength": 2, "maxLength": 20}, "What name should I put the booking under?",
         instruction="Which name is the table booked under? Answer none if the message does not say.",
         examples=[("It's for Tom.", "Tom"), ("On Monday at 8.", None), ("The name is Anna.", "Anna"),
                   ("My surname is Brown.", "Brown"), ("Hello, I want a table.", None), ("Great, Sunday then.", None),
                   ("Book it for Lee please.", "Lee"), ("Yes, that's right.", None)]),
]

INTENTS = {
    "hello": ["Hello!", "Good evening.", "Hi, how are you?"],
    "booking": ["I want to book a table for 2 people.", "There will be six of us.", "Tuesday please.", "At 18:00.",
                "It's for Tom.", "Can I reserve a table for tonight?", "The name is Anna.", "Make it 8 people instead.",
                "Let's do Saturday at 19:00."],
    "other": ["Is the fish fresh?", "What desserts do you have?", "Where can I park my car?", "When do you open?",
              "Is the soup spicy?", "Can I pay by card?", "Do you have a wine list?", "Are dogs allowed inside?",
              "Do you have gluten free pasta?"],
    "ok": ["Yes, that's right.", "Yes, go ahead and book it.", "Sounds good.", "Perfect, please confirm that.", "Correct."],
    "no": ["No, that's wrong.", "No.", "Not quite."],
    "bye": ["No thanks, bye!", "Thanks, goodbye.", "See you!"],
}

TOPICS = [
    Topic("booking", intents=["booking"], slots=SLOTS, resume_text="Now, back to your booking."),
    Topic("question", intents=["other"], digression=True),  # any other question: answered, then back
]

SYSTEM_PROMPT = (
    "You are the assistant of Trattoria Pagoda, an Italian restaurant. Answer in one short, friendly sentence. "
    "Facts: open Tuesday to Sunday from 12:00 to 23:00. Vegetarian dishes: mushroom risotto (it can be made vegan), "
    "margherita pizza, minestrone soup. Free parking behind the restaurant. Dogs are welcome on the terrace."
)


ONE_SENTENCE = r"[A-Z][^\n.!?]*[.!?]"  # a generated answer is one sentence (a 135M model rambles)


def _answer_question(state, nlu):
    """A question in the middle of a booking is answered, then the booking is brought back up."""
    if state.stack.find("booking") is not None:
        return answer(then="Shall we go on with your booking?", regex=ONE_SENTENCE)
    return answer(then="Anything else?", regex=ONE_SENTENCE)


POLICY = StateTable({
    ("*", "bye"): say("Thank you, goodbye!", name="bye"),
    ("booking", "missing"): ask(),  # the first empty slot's question
    ("booking", "ok"): complete("Done! Your table for {party_size} on {day} at {time} is booked under the name "
                                "{name}. Can I help with anything else?", name="book"),
    ("booking", "no"): say("No problem: tell me what to change.", name="change"),
    ("booking", "always"): say("So that is a table for {party_size} on {day} at {time}, under the name {name}. "
                               "Shall I book it?", name="confirm"),
    ("question", "always"): _answer_question,
    ("*", "hello"): say("Hello! Welcome to Trattoria Pagoda. I can book you a table or answer your questions.",
                        name="greet"),
    (None, "always"): say("I can book you a table or answer questions about the restaurant.", name="help"),
})

# The scripted conversation: a booking, a digression about the menu, back to the booking (with a
# change before confirming), then two more questions and goodbye.
SCRIPT = [
    "Hi there!",
    "I'd like to book a table for four people.",
    "On Friday, please.",
    "Do you have vegetarian options?",
    "Is the mushroom risotto vegan?",
    "Great. Let's say 19:30 then.",
    "My name is Maria.",
    "Actually, make it 5 people.",
    "Yes, please confirm.",
    "Can I bring my dog?",
    "Is there parking nearby?",
    "Thank you, goodbye!",
]


def build(backend, reply_tokens: int = 40) -> Dialogue:
    return Dialogue(backend, topics=TOPICS, intents=INTENTS, policy=POLICY, system_prompt=SYSTEM_PROMPT,
                    domain="a restaurant customer", name="restaurant", reply_tokens=reply_tokens)


def engine(model: str = "smollm2-135m-instruct", *, naive: bool = False, quantization: str | None = "gguf",
           **kwargs) -> lang.Engine:
    """The in-process engine; `naive` turns the prefix cache off."""
    return lang.Engine(model, quantization=quantization, enable_prefix_caching=not naive, **kwargs)


def print_turn(turn) -> None:
    print(f"[{turn.index:2}] user: {turn.user}")
    print(f"     assistant: {turn.reply}")
    slots = f" slots={turn.slots}" if turn.slots else ""
    print(f"     ({turn.intent} -> {turn.action}; stack {turn.stack}{slots}; {turn.computed_tokens} of "
          f"{turn.prompt_tokens} prompt tokens computed; {turn.latency_s:.2f} s)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--quantization", default="gguf", help="gguf (the GGUF's own blocks, the fast path) or none")
    p.add_argument("--naive", action="store_true", help="prefix caching off: every prompt recomputes the whole history")
    p.add_argument("--interactive", action="store_true")
    p.add_argument("--reply-tokens", type=int, default=40, help="max tokens of a generated answer")
    args = p.parse_args(argv)
    app = build(engine(args.model, naive=args.naive, quantization=None if args.quantization == "none" else args.quantization),
                args.reply_tokens)
    app.prepare()  # the NLU prompts, encoded once
    session = app.session()
    try:
        messages = iter(lambda: input("you> "), "") if args.interactive else SCRIPT
        for message in messages:
            print_turn(session.say(message))
        print(f"\ntopic stack: {session.stack.names()}; events: {session.stack.events}")
        for frame in session.stack.closed + session.stack.frames:
            if frame.name == "booking":
                print(f"booking ({frame.status}): {frame.values}")
        print("\nturn  history  computed: transcript  nlu  total  latency_s")
        for t in session.turns:
            print(f"{t.index:4}  {t.transcript_tokens:7}  {t.tokens('transcript'):20}  {t.tokens('nlu'):3}  "
                  f"{t.computed_tokens:5}  {t.latency_s:9.2f}")
    finally:
        session.close()
        app.close()


if __name__ == "__main__":
    main()
