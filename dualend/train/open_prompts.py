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
        "fountain pen", "sundial", "hourglass", "electric kettle", "toaster", "air conditioner", "ceiling fan",
        "water filter", "smoke detector", "traffic light", "escalator", "parachute", "sewing needle", "metronome",
        "harmonica", "accordion", "trumpet", "drum kit", "magnifying glass", "pressure cooker", "blender",
        "electric scooter", "steam locomotive", "canoe", "snow shovel", "garden hose", "wheelbarrow", "ladder",
        "loudspeaker", "keyboard", "computer mouse", "hard drive", "wristwatch", "sleeping bag", "fire extinguisher",
    ),
    "nature": (
        "the water cycle", "photosynthesis", "volcanoes", "ocean tides", "rainbows", "earthquakes",
        "the northern lights", "thunderstorms", "the seasons", "erosion", "the moon's phases", "snowflakes",
        "coral reefs", "glaciers", "hurricanes", "fog", "the rock cycle", "deserts", "the carbon cycle",
        "migration of birds", "the sea", "sunsets", "rivers", "the night sky", "autumn leaves", "lightning",
        "the rain forest", "wind", "the human heart", "sleep", "gravity", "magnetism", "evolution",
        "the ozone layer", "clouds", "waterfalls", "caves", "sand dunes", "the food chain", "pollination",
        "tornadoes", "tsunamis", "geysers", "the solar system", "comets", "eclipses", "the immune system",
        "digestion", "dreams", "soil", "mountains", "wetlands", "the tundra", "mushrooms", "seeds", "dew",
        "hail", "the Milky Way", "black holes", "the greenhouse effect", "ocean currents", "wildfires",
    ),
    "activity": (
        "running", "gardening", "chess", "painting", "swimming", "learning a new language", "cooking",
        "photography", "hiking", "yoga", "playing the guitar", "writing poetry", "meditation", "cycling",
        "reading", "knitting", "birdwatching", "rock climbing", "baking bread", "public speaking",
        "programming", "dancing", "journaling", "camping", "fishing", "volunteering", "exercise",
        "saving money", "studying for exams", "drawing", "skiing", "playing basketball", "woodworking",
        "surfing", "sailing", "bowling", "playing the piano", "singing in a choir", "pottery", "sculpting",
        "origami", "juggling", "skateboarding", "ice skating", "horse riding", "table tennis", "playing soccer",
        "martial arts", "chess puzzles", "crossword puzzles", "bird photography", "scuba diving", "kayaking",
        "calligraphy", "composting", "sewing", "running a marathon", "learning to code", "podcasting",
        "mountain biking", "weight lifting", "stargazing", "beekeeping",
    ),
    "place": (
        "Paris", "Tokyo", "the Amazon rainforest", "Egypt", "Iceland", "New York City", "the Sahara desert",
        "Rome", "Australia", "the Grand Canyon", "Kenya", "Peru", "Norway", "Venice", "India", "Canada",
        "the Alps", "Mexico City", "Istanbul", "Scotland", "New Zealand", "Brazil", "Antarctica", "Lisbon",
        "Thailand", "Morocco", "Greece", "Vietnam", "Chile", "Berlin", "France", "Seoul",
        "London", "Madrid", "Barcelona", "Vienna", "Prague", "Amsterdam", "Cairo", "Buenos Aires",
        "Cape Town", "Singapore", "Hong Kong", "Sydney", "Dublin", "Stockholm", "Helsinki", "Budapest",
        "Mount Everest", "the Great Barrier Reef", "Yellowstone", "the Nile", "Hawaii", "Alaska", "Japan",
        "Italy", "Spain", "Portugal", "Argentina", "Cuba", "Jordan", "Nepal", "Mongolia", "the Caribbean",
    ),
    "job": (
        "a nurse", "a teacher", "a firefighter", "a software engineer", "a chef", "a farmer", "a librarian",
        "a pilot", "an architect", "a veterinarian", "a journalist", "an electrician", "a scientist",
        "a police officer", "a dentist", "a gardener", "a museum guide", "a bus driver", "a photographer",
        "an astronaut", "a carpenter", "a lawyer", "a pharmacist", "a translator", "a baker",
        "a plumber", "a mechanic", "a judge", "an accountant", "a musician", "a painter", "a surgeon",
        "a tailor", "a zookeeper", "a park ranger", "a flight attendant", "a data analyst", "a social worker",
        "a mail carrier", "a coach", "a fisherman", "a game designer", "an engineer", "a banker", "a barber",
        "a florist", "a referee", "a paramedic", "a web designer", "a professor", "a ship captain",
    ),
    "idea": (
        "friendship", "time management", "climate change", "kindness", "renewable energy", "democracy",
        "recycling", "social media", "remote work", "artificial intelligence", "healthy eating",
        "honesty", "curiosity", "teamwork", "space exploration", "online learning", "city parks",
        "public transport", "music education", "failure", "creativity", "patience", "privacy", "tourism",
        "Romeo and Juliet", "the printing press", "the internet", "the scientific method", "voting",
        "gratitude", "leadership", "free speech", "globalization", "minimalism", "self-discipline",
        "the Renaissance", "the Industrial Revolution", "electric cars", "universal healthcare", "homework",
        "video games", "space tourism", "urban gardening", "open source software", "freedom", "justice",
        "courage", "empathy", "lifelong learning", "fast fashion", "sustainable farming", "zoos",
        "the four-day work week", "screen time for children", "nuclear power", "the Olympic Games",
        "the theory of relativity", "Hamlet", "the French Revolution",
    ),
    "food": (
        "pancakes", "tomato soup", "sushi", "banana bread", "a green salad", "pizza", "lentil curry",
        "chocolate chip cookies", "scrambled eggs", "guacamole", "apple pie", "fried rice", "hummus",
        "lemonade", "oatmeal", "vegetable stir fry", "mashed potatoes", "a smoothie", "pasta carbonara",
        "dumplings", "tacos", "french toast", "yogurt", "cheese",
        "paella", "ramen", "croissants", "a burrito", "falafel", "chili", "pumpkin pie", "risotto",
        "a cheese omelette", "miso soup", "granola", "carrot cake", "lasagna", "pad thai", "bread pudding",
        "a fruit salad", "hot chocolate", "roast chicken", "spring rolls", "popcorn", "ice cream", "couscous",
        "pesto", "a grilled cheese sandwich", "waffles", "lemon tart", "beef stew", "green tea",
    ),
    "animal": (
        "dolphins", "elephants", "penguins", "honeybees", "owls", "wolves", "octopuses", "butterflies",
        "sea turtles", "foxes", "kangaroos", "cats", "dogs", "eagles", "frogs", "giraffes", "ants",
        "whales", "horses", "parrots", "bats", "lions", "rabbits", "sharks",
        "tigers", "bears", "zebras", "camels", "gorillas", "koalas", "pandas", "hedgehogs", "squirrels",
        "crows", "hummingbirds", "flamingos", "jellyfish", "crabs", "snails", "spiders", "salmon", "seals",
        "otters", "beavers", "deer", "goats", "chickens", "cows", "lizards", "crocodiles", "swans", "moles",
    ),
    "task": (
        "my manager asking for a day off", "a neighbor about a noisy party", "a friend I have not seen in years",
        "my landlord about a broken heater", "a teacher about my child's homework", "a customer apologizing for "
        "a late delivery", "a colleague thanking them for their help", "a hotel asking about a late check-in",
        "my team announcing a new project", "a company applying for an internship", "a club inviting new "
        "members", "my grandmother for her birthday", "a shop asking for a refund", "a speaker inviting them "
        "to a conference", "a roommate about sharing chores",
        "my doctor asking to move an appointment", "a friend congratulating them on a new job",
        "my coach explaining why I missed practice", "a new neighbor welcoming them", "my bank about a wrong charge",
        "a client following up on a proposal", "my sister asking for advice", "a professor asking for an extension",
        "an author telling them I loved their book", "my team after a difficult week",
        "a plumber asking for a quote", "a volunteer thanking them for their time",
        "the city council about a broken streetlight", "a mentor asking for a meeting",
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
