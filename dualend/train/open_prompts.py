"""Open-ended chat requests (explain, describe, list, advise, write) for distilling a draft head on
the answers users ask for, beside the project's short task questions (`data.FAMILIES`).

Each request is a template of a kind of topic filled with one topic. The split goes by topic, so a
held-out request is about something training never saw; the topics of the served benchmarks'
questions (`BENCHMARK_TOPICS`) are always held out.
"""
from __future__ import annotations

import hashlib
import random

TEMPLATES = {
    "object": (
        "Explain how a {} works.", "What is a {} used for?", "Describe the history of the {}.",
        "Write a short poem about a {}.", "What are the main parts of a {}?",
        "Give me three tips for taking care of a {}.", "How would you explain a {} to a child?",
        "What should I look for when buying a {}?", "Write a short story in which a {} plays a key role.",
        "What are the advantages and disadvantages of a {}?",
    ),
    "nature": (
        "Explain {} in simple terms.", "Why does {} happen?", "Write a paragraph about {} for a ten-year-old.",
        "What are the most interesting facts about {}?", "How does {} affect people?",
        "Write a haiku about {}.", "Describe {} to someone who has never seen it.",
        "What do scientists still not understand about {}?",
    ),
    "activity": (
        "What are the benefits of {}?", "How do I get started with {}?", "Give me five tips for {}.",
        "Write a short story about someone who loves {}.", "What equipment do I need for {}?",
        "What are common mistakes beginners make in {}?", "Make a weekly plan for improving at {}.",
        "Why do people enjoy {}?", "Write a motivational message for someone who is learning {}.",
    ),
    "place": (
        "Tell me about {}.", "What is {} famous for?", "Plan a three-day trip to {}.",
        "What is the history of {}?", "What food should I try in {}?", "Describe the climate of {}.",
        "Write a postcard message from {}.", "What should a visitor know before going to {}?",
    ),
    "job": (
        "What does {} do in a typical day?", "Write a thank-you note to {}.",
        "What skills does {} need?", "How do I become {}?", "What are the challenges of working as {}?",
        "Write a job advertisement for {}.", "Describe a day in the life of {}.",
    ),
    "idea": (
        "Write the opening paragraph of an essay about {}.", "What are the pros and cons of {}?",
        "Explain the main ideas of {}.", "Why is {} important?", "Give three examples of {} in everyday life.",
        "Write a short speech about {}.", "How can I teach my friends about {}?",
        "Summarize the debate about {} in a few sentences.",
    ),
    "food": (
        "How do you make {}?", "Is {} healthy?", "Write a recipe for {}.", "What is the origin of {}?",
        "What goes well with {}?", "Describe the taste of {} to someone who has never tried it.",
        "Write a short restaurant review of a place known for {}.",
    ),
    "animal": (
        "Describe the habitat of {}.", "Write a list of fun facts about {}.", "What do {} eat?",
        "How do {} raise their young?", "Write a children's story about {}.", "Are {} endangered? Why?",
        "How do {} communicate?",
    ),
    "task": (
        "Write an email to {}.", "Help me write a message to {}.", "Write a polite note to {}.",
        "Draft a short letter to {}.",
    ),
}

TOPICS = {
    "object": (
        "bicycle", "refrigerator", "camera", "clock", "rocket", "piano", "battery", "compass", "telescope",
        "microwave oven", "printer", "car engine", "kite", "door lock", "radio", "thermometer", "smartphone",
        "washing machine", "umbrella", "lighthouse", "solar panel", "wind turbine", "sewing machine", "violin",
        "calculator", "vacuum cleaner", "electric guitar", "submarine", "hot air balloon", "typewriter",
        "microscope", "elevator", "dishwasher", "headphone", "bridge", "sailboat", "tent", "backpack",
        "coffee machine", "light bulb", "helicopter", "skateboard", "barometer", "drone", "3D printer",
    ),
    "nature": (
        "the water cycle", "photosynthesis", "volcanoes", "ocean tides", "rainbows", "earthquakes",
        "the northern lights", "thunderstorms", "the seasons", "erosion", "the moon's phases", "snowflakes",
        "coral reefs", "glaciers", "hurricanes", "fog", "the rock cycle", "deserts", "the carbon cycle",
        "migration of birds", "the sea", "sunsets", "rivers", "the night sky", "autumn leaves", "lightning",
        "the rain forest", "wind", "the human heart", "sleep", "gravity", "magnetism", "evolution",
    ),
    "activity": (
        "running", "gardening", "chess", "painting", "swimming", "learning a new language", "cooking",
        "photography", "hiking", "yoga", "playing the guitar", "writing poetry", "meditation", "cycling",
        "reading", "knitting", "birdwatching", "rock climbing", "baking bread", "public speaking",
        "programming", "dancing", "journaling", "camping", "fishing", "volunteering", "exercise",
        "saving money", "studying for exams", "drawing", "skiing", "playing basketball", "woodworking",
    ),
    "place": (
        "Paris", "Tokyo", "the Amazon rainforest", "Egypt", "Iceland", "New York City", "the Sahara desert",
        "Rome", "Australia", "the Grand Canyon", "Kenya", "Peru", "Norway", "Venice", "India", "Canada",
        "the Alps", "Mexico City", "Istanbul", "Scotland", "New Zealand", "Brazil", "Antarctica", "Lisbon",
        "Thailand", "Morocco", "Greece", "Vietnam", "Chile", "Berlin", "France", "Seoul",
    ),
    "job": (
        "a nurse", "a teacher", "a firefighter", "a software engineer", "a chef", "a farmer", "a librarian",
        "a pilot", "an architect", "a veterinarian", "a journalist", "an electrician", "a scientist",
        "a police officer", "a dentist", "a gardener", "a museum guide", "a bus driver", "a photographer",
        "an astronaut", "a carpenter", "a lawyer", "a pharmacist", "a translator", "a baker",
    ),
    "idea": (
        "friendship", "time management", "climate change", "kindness", "renewable energy", "democracy",
        "recycling", "social media", "remote work", "artificial intelligence", "healthy eating",
        "honesty", "curiosity", "teamwork", "space exploration", "online learning", "city parks",
        "public transport", "music education", "failure", "creativity", "patience", "privacy", "tourism",
        "Romeo and Juliet", "the printing press", "the internet", "the scientific method", "voting",
    ),
    "food": (
        "pancakes", "tomato soup", "sushi", "banana bread", "a green salad", "pizza", "lentil curry",
        "chocolate chip cookies", "scrambled eggs", "guacamole", "apple pie", "fried rice", "hummus",
        "lemonade", "oatmeal", "vegetable stir fry", "mashed potatoes", "a smoothie", "pasta carbonara",
        "dumplings", "tacos", "french toast", "yogurt", "cheese",
    ),
    "animal": (
        "dolphins", "elephants", "penguins", "honeybees", "owls", "wolves", "octopuses", "butterflies",
        "sea turtles", "foxes", "kangaroos", "cats", "dogs", "eagles", "frogs", "giraffes", "ants",
        "whales", "horses", "parrots", "bats", "lions", "rabbits", "sharks",
    ),
    "task": (
        "my manager asking for a day off", "a neighbor about a noisy party", "a friend I have not seen in years",
        "my landlord about a broken heater", "a teacher about my child's homework", "a customer apologizing for "
        "a late delivery", "a colleague thanking them for their help", "a hotel asking about a late check-in",
        "my team announcing a new project", "a company applying for an internship", "a club inviting new "
        "members", "my grandmother for her birthday", "a shop asking for a refund", "a speaker inviting them "
        "to a conference", "a roommate about sharing chores",
    ),
}

# The subjects of the chat questions the served draft benchmarks asked before this set existed
# (reports/fused_backbone/served_drafts_floor.txt) and of the first questions users try: held out,
# whatever their topic's hash says.
BENCHMARK_TOPICS = frozenset({"bicycle", "refrigerator", "the sea", "the water cycle", "exercise",
                              "learning a new language", "Romeo and Juliet", "France", "Paris"})
HELD_OUT_SHARE = 0.15


def topic_split(topic: str) -> str:
    if topic in BENCHMARK_TOPICS:
        return "held_out"
    share = int.from_bytes(hashlib.sha256(f"open-topic\x00{topic}".encode()).digest()[:4], "big") / 2 ** 32
    return "held_out" if share < HELD_OUT_SHARE else "train"


def open_prompts(split: str, seed: int = 0) -> list[str]:
    """Every request of `split` ("train" or "held_out"), shuffled by `seed`."""
    prompts = [template.format(topic) for kind, topics in TOPICS.items() for topic in topics
               if topic_split(topic) == split for template in TEMPLATES[kind]]
    random.Random(f"open-prompts-{split}-{seed}").shuffle(prompts)
    return prompts
