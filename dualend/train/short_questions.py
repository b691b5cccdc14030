"""Short chat questions with a short answer (capitals, colours, counts, words, arithmetic), for the
conversion's chat rows: the teacher's answers to them end with EOS after a sentence or two, which
neither the project's task families nor the open-ended requests (cut at `--chat-tokens`) show often.

The task check's questions (builder/data/chat_questions.json) are of these kinds and stay held out, so
that the check measures whether the converted model answers as its base does on questions it never
trained on: no subject's words (a unit's container's) stand in one of them, singular or plural
(tests/test_conversion.py checks it), no arithmetic question asks what one of them asks, and what would
ask one of their facts in other words is kept off the lists by hand.
"""
from __future__ import annotations

import random
import re

TEMPLATES = {
    "country": ("What is the capital of {}?", "What language is spoken in {}?", "What is the currency of {}?",
                "On which continent is {}?"),
    "animal": ("What does {} eat?", "Where does {} live?", "What sound does {} make?"),
    "legs": ("How many legs does {} have?",),
    "thing_colour": ("What color is {}?",),
    "opposite": ("What is the opposite of {}?",),
    "plural": ("What is the plural of {}?",),
    "past": ("What is the past tense of {}?",),
    "units": ("How many {} are in {}?",),
    "shape": ("How many sides does {} have?",),
    "element": ("What is the chemical symbol for {}?",),
    "book": ("Who wrote {}?",),
    "painting": ("Who painted {}?",),
    "month": ("Which month comes after {}?", "Which month comes before {}?"),
    "weekday": ("Which day comes after {}?", "Which day comes before {}?"),
}

# Kept off these lists by hand, beyond what the test's word match finds: what asks a task-check question's
# fact again in other words (an insect's or a bird's legs, another Shakespeare play, coal's colour, ...).
SUBJECTS = {
    "country": ("Chile", "Colombia", "Venezuela", "Turkey", "Iran", "Pakistan", "Vietnam", "Indonesia",
                "the Philippines", "Malaysia", "Nigeria", "Ghana", "Ethiopia", "Morocco", "Algeria", "Switzerland",
                "Hungary", "the Czech Republic", "Romania", "Ukraine", "New Zealand", "Saudi Arabia", "Iceland",
                "Croatia", "Bulgaria", "Bolivia", "Ecuador", "Uruguay", "Nepal", "Sri Lanka", "Bangladesh",
                "Tanzania", "Uganda", "Senegal", "Tunisia", "Qatar", "Mongolia", "Cambodia", "Jamaica",
                "Panama", "Costa Rica", "Serbia", "Slovakia", "Latvia", "Estonia", "Lithuania"),
    "animal": ("a horse", "a sheep", "a goat", "a pig", "a chicken", "a duck", "an owl", "an eagle", "a shark",
               "an octopus", "a crab", "an ant", "a snake", "a turtle", "a rabbit", "a bear", "a wolf", "a fox",
               "a deer", "a kangaroo", "a penguin", "a zebra", "a camel", "a monkey", "a gorilla", "a dolphin",
               "a squirrel", "a beetle", "a lobster", "a starfish", "a koala", "a hippo"),
    "legs": ("a horse", "a sheep", "a goat", "a pig", "a snake", "a turtle", "a rabbit", "a bear", "a wolf",
             "a fox", "a deer", "a kangaroo", "a zebra", "a camel", "a monkey", "a gorilla", "an octopus",
             "a crab", "a lobster", "a starfish", "a koala", "a hippo", "a squirrel"),
    "thing_colour": ("a lemon", "a lime", "a strawberry", "a pumpkin", "an eggplant", "a cucumber",
                     "a fire truck", "a school bus", "chocolate", "a ruby", "an emerald", "a sapphire",
                     "a flamingo", "a crow", "a polar bear", "a cherry", "a blueberry", "a raven", "a pearl",
                     "a plum", "a stop sign", "an orange"),
    "opposite": ("fast", "happy", "light", "old", "open", "full", "wet", "early", "loud", "rich", "hard",
                 "push", "left", "north", "win", "strong", "slow", "tall", "thick", "sweet", "begin", "above",
                 "inside", "true", "clean", "empty", "heavy", "near"),
    "plural": ("goose", "tooth", "foot", "man", "woman", "cherry", "ox", "cactus", "leaf", "knife", "wolf",
               "sheep", "fish", "box", "church", "story", "potato", "hero", "wife", "life"),
    "past": ("drive", "run", "see", "ride", "swim", "sing", "take", "buy", "think", "fall", "grow", "drink",
             "fly", "give", "speak", "break", "choose", "teach", "catch", "sleep", "begin", "bring"),
    # what is counted | what holds it: the container is never one of a task-check question's
    "units": ("meters|a kilometer", "ounces|a pound", "inches|a foot", "feet|a yard", "days|a fortnight",
              "years|a decade", "years|a millennium", "quarts|a gallon", "cents|a dollar", "eggs|a dozen",
              "pints|a quart", "milliliters|a liter"),
    "shape": ("a heptagon", "a nonagon", "a decagon", "a dodecagon", "a circle"),
    "element": ("iron", "silver", "sodium", "carbon", "helium", "copper", "nitrogen", "calcium", "potassium",
                "lead", "zinc", "tin", "neon", "uranium"),
    "book": ("Pride and Prejudice", "1984", "The Odyssey", "Don Quixote", "War and Peace", "Moby-Dick",
             "A Christmas Carol", "Oliver Twist", "The Adventures of Tom Sawyer", "Frankenstein", "Dracula",
             "The Great Gatsby", "Les Miserables", "The Divine Comedy", "Jane Eyre",
             "Alice's Adventures in Wonderland", "The Hobbit", "Crime and Punishment"),
    "painting": ("The Starry Night", "The Scream", "Guernica", "The Persistence of Memory", "The Birth of Venus",
                 "Girl with a Pearl Earring", "The Night Watch", "Water Lilies", "American Gothic"),
    "month": ("April", "May", "August", "September", "October", "November", "December"),
    "weekday": ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"),
}

OPERATIONS = (("plus", lambda a, b: True), ("minus", lambda a, b: a > b), ("times", lambda a, b: a <= 12 and b <= 12),
              ("divided by", lambda a, b: b > 1 and a % b == 0))


def subject_questions() -> list[tuple[str, str]]:
    """(subject, question) for every template of each kind and subject of it."""
    out = []
    for kind, templates in TEMPLATES.items():
        for subject in SUBJECTS[kind]:
            for template in templates:
                out.append((subject, template.format(*subject.split("|"))))
    return out


def arithmetic_questions(seed: int) -> list[str]:
    """'What is A plus B?' and its kin for small numbers, in an order set by `seed`."""
    questions = [f"What is {a} {name} {b}?" for a in range(2, 41) for b in range(2, 41)
                 for name, fits in OPERATIONS if fits(a, b)]
    random.Random(f"short-arithmetic-{seed}").shuffle(questions)
    return questions


ARITHMETIC = re.compile(r"What is (\d+) (plus|minus|times|divided by) (\d+)\?|What is half of (\d+)\?")


def arithmetic_form(question: str) -> tuple | None:
    """What an arithmetic question asks, whatever its words: the same for '3 plus 5', '5 plus 3'
    and for 'half of 10', '10 divided by 2'; None for other questions."""
    found = ARITHMETIC.fullmatch(question)
    if not found:
        return None
    if found[4]:
        return "divided by", int(found[4]), 2
    a, name, b = int(found[1]), found[2], int(found[3])
    return (name, *sorted((a, b))) if name in ("plus", "times") else (name, a, b)


def short_questions(count: int, seed: int = 0, exclude: frozenset[str] = frozenset()) -> list[str]:
    """`count` questions (at most all of them): every fourth arithmetic, the rest the subjects' questions,
    each list shuffled by `seed`; none in `exclude`, and no arithmetic question asking what one of those does."""
    excluded_sums = {arithmetic_form(q) for q in exclude} - {None}
    worded = [q for _, q in subject_questions() if q not in exclude]
    random.Random(f"short-questions-{seed}").shuffle(worded)
    sums = [q for q in arithmetic_questions(seed) if arithmetic_form(q) not in excluded_sums]
    out, w, s = [], iter(worded), iter(sums)
    for i in range(count):
        question = next(s, None) if i % 4 == 3 else next(w, None)
        question = question or next(w, None) or next(s, None)
        if question is None:
            break
        out.append(question)
    return out
