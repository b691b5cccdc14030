"""Short chat questions with a short answer (capitals, colours, counts, words, arithmetic), for the
conversion's chat rows: the teacher's answers to them end with EOS after a sentence or two, which
neither the project's task families nor the open-ended requests (cut at `--chat-tokens`) show often.

The task check's questions (builder/data/chat_questions.json) are of these kinds and stay held out:
no subject here is the subject of one of them (tests/test_conversion.py checks it), so the check
measures whether the converted model answers as its base does on questions it never trained on.
"""
from __future__ import annotations

import random

TEMPLATES = {
    "country": ("What is the capital of {}?", "What language is spoken in {}?", "What is the currency of {}?",
                "On which continent is {}?"),
    "animal": ("How many legs does a {} have?", "What does a {} eat?", "Where does a {} live?",
               "What sound does a {} make?"),
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

SUBJECTS = {
    "country": ("Chile", "Colombia", "Venezuela", "Turkey", "Iran", "Pakistan", "Vietnam", "Indonesia",
                "the Philippines", "Malaysia", "Nigeria", "Ghana", "Ethiopia", "Morocco", "Algeria", "Switzerland",
                "Hungary", "the Czech Republic", "Romania", "Ukraine", "New Zealand", "Saudi Arabia", "Iceland",
                "Croatia", "Bulgaria", "Bolivia", "Ecuador", "Uruguay", "Nepal", "Sri Lanka", "Bangladesh",
                "Tanzania", "Uganda", "Senegal", "Tunisia", "Qatar", "Mongolia", "Cambodia", "Jamaica",
                "Panama", "Costa Rica", "Serbia", "Slovakia", "Latvia", "Estonia", "Lithuania"),
    "animal": ("horse", "sheep", "goat", "pig", "chicken", "duck", "owl", "eagle", "shark", "octopus", "crab",
               "ant", "snake", "turtle", "rabbit", "bear", "wolf", "fox", "deer", "kangaroo", "penguin",
               "zebra", "camel", "monkey", "gorilla", "dolphin", "squirrel", "beetle", "lobster", "starfish",
               "koala", "hippo"),
    "thing_colour": ("a lemon", "a lime", "a strawberry", "a pumpkin", "an eggplant", "a cucumber",
                     "a fire truck", "a school bus", "chocolate", "a ruby", "an emerald", "a sapphire",
                     "a flamingo", "a crow", "a polar bear", "a cherry", "a blueberry", "a raven", "a pearl",
                     "a plum", "charcoal", "a stop sign", "an orange", "a banana peel when it is old"),
    "opposite": ("fast", "happy", "light", "old", "open", "full", "wet", "early", "loud", "rich", "hard",
                 "push", "left", "north", "win", "strong", "slow", "tall", "thick", "sweet", "begin", "above",
                 "inside", "true", "clean", "empty", "heavy", "near"),
    "plural": ("goose", "tooth", "foot", "man", "woman", "cherry", "ox", "cactus", "leaf", "knife", "wolf",
               "sheep", "fish", "box", "church", "story", "potato", "hero", "wife", "life"),
    "past": ("drive", "run", "see", "ride", "swim", "sing", "take", "buy", "think", "fall", "come", "drink",
             "fly", "give", "speak", "break", "choose", "teach", "catch", "sleep", "begin", "bring"),
    "units": ("millimeters|a centimeter", "meters|a kilometer", "ounces|a pound", "inches|a foot",
              "feet|a yard", "days|a fortnight", "hours|a week", "years|a decade", "years|a millennium",
              "quarts|a gallon", "cents|a dollar", "eggs|a dozen", "minutes|half an hour", "days|a year",
              "seconds|an hour", "months|half a year", "pints|a quart", "milliliters|a liter"),
    "shape": ("a heptagon", "a nonagon", "a decagon", "a dodecagon", "a quadrilateral", "a rectangle",
              "a rhombus", "a circle"),
    "element": ("oxygen", "iron", "silver", "sodium", "carbon", "hydrogen", "helium", "copper", "nitrogen",
                "calcium", "potassium", "lead", "zinc", "tin", "neon", "uranium"),
    "book": ("Macbeth", "Pride and Prejudice", "1984", "The Odyssey", "Don Quixote", "War and Peace",
             "Moby-Dick", "A Christmas Carol", "Oliver Twist", "The Adventures of Tom Sawyer", "Frankenstein",
             "Dracula", "The Great Gatsby", "Othello", "Les Miserables", "The Divine Comedy", "Jane Eyre",
             "Alice's Adventures in Wonderland", "The Hobbit", "Crime and Punishment"),
    "painting": ("The Starry Night", "The Last Supper", "The Scream", "Guernica", "The Persistence of Memory",
                 "The Birth of Venus", "Girl with a Pearl Earring", "The Night Watch", "Water Lilies",
                 "American Gothic"),
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


def short_questions(count: int, seed: int = 0, exclude: frozenset[str] = frozenset()) -> list[str]:
    """`count` questions (at most all of them): every fourth arithmetic, the rest the subjects' questions,
    each list shuffled by `seed`; none in `exclude`."""
    worded = [q for _, q in subject_questions() if q not in exclude]
    random.Random(f"short-questions-{seed}").shuffle(worded)
    sums = [q for q in arithmetic_questions(seed) if q not in exclude]
    out, w, s = [], iter(worded), iter(sums)
    for i in range(count):
        question = next(s, None) if i % 4 == 3 else next(w, None)
        question = question or next(w, None) or next(s, None)
        if question is None:
            break
        out.append(question)
    return out
