"""Open-ended chat requests (explain, describe, list, advise, write) for distilling a draft head on
the answers users ask for, beside the project's short task questions (`data.FAMILIES`).

Each request is a template of a kind of topic filled with one topic. The split goes by topic, so a
held-out request is about something training never saw; the topics of the served benchmarks'
questions (`BENCHMARK_TOPICS`) are always held out. Topics come in editions: a later edition's requests
follow every earlier one's in each list, so adding topics never changes a list's first requests (the
records and benchmarks made before keep theirs).
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

FIRST_TOPICS = {
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

# 590 topics more (2026-12-05), written to fit every template of their kind
SECOND_TOPICS = {
    "object": (
        "food processor", "slow cooker", "rice cooker", "waffle iron", "stand mixer", "hair dryer", "toothbrush",
        "space heater", "humidifier", "treadmill", "rowing machine", "lawn mower", "leaf blower", "chainsaw",
        "power drill", "hammer", "screwdriver", "tape measure", "flashlight", "thermos", "pocket knife",
        "pressure washer", "shopping cart", "trampoline", "saxophone", "flute", "cello", "banjo", "xylophone", "harp",
        "record player", "television", "projector", "laptop", "tablet computer", "wifi router", "memory card", "webcam",
        "microphone", "doorbell", "thermostat", "lawn sprinkler", "greenhouse", "water wheel", "spinning wheel", "loom",
        "globe", "pencil sharpener", "stapler", "paper shredder", "whiteboard", "zipper", "mirror", "candle",
        "fireplace", "wood stove", "radiator", "water heater", "garage door opener", "kitchen scale", "can opener",
        "corkscrew", "frying pan", "teapot", "french press", "juicer", "steam iron", "tumble dryer", "motorcycle",
        "tractor", "snowmobile", "periscope", "kaleidoscope", "yo-yo", "Rubik's cube", "music box", "jigsaw puzzle",
        "hammock", "desk lamp", "vending machine", "cash register", "mailbox", "suitcase", "baby stroller", "seat belt",
        "windshield wiper", "speedometer", "pedometer", "stopwatch", "pulley",
    ),
    "nature": (
        "frost", "rain", "humidity", "the nitrogen cycle", "metamorphosis", "hibernation", "camouflage",
        "bioluminescence", "echolocation", "fermentation", "decomposition", "evaporation", "static electricity",
        "friction", "buoyancy", "an echo", "a meteor shower", "a heat wave", "a drought", "a flood", "a landslide",
        "an avalanche", "the monsoon", "a blizzard", "a sandstorm", "a waterspout", "a sinkhole", "a whirlpool",
        "a mirage", "a rogue wave", "the jet stream", "permafrost", "the midnight sun", "a supermoon",
        "plate tectonics", "the color of the sky", "birdsong", "yawning", "sneezing", "aging", "the Doppler effect",
        "a sonic boom", "a moon halo", "an algae bloom", "the spring thaw", "an ice storm", "smog",
        "the Coriolis effect", "the polar night", "rust", "fruit ripening", "phototropism",
        "a murmuration of starlings", "a storm surge", "a cold front", "the twinkling of stars", "a supernova",
        "a solar flare", "the summer solstice", "laughter", "jet lag", "brain freeze", "a rain shadow", "wind chill",
        "symbiosis", "fossilization", "crystal formation", "the refraction of light", "an ice age", "twilight",
    ),
    "activity": (
        "playing tennis", "playing golf", "archery", "fencing", "rowing", "snowboarding", "paddleboarding",
        "playing badminton", "playing volleyball", "playing baseball", "playing hockey", "boxing", "pilates", "tai chi",
        "gymnastics", "roller skating", "jumping rope", "parkour", "foraging", "playing the violin",
        "playing the drums", "playing the ukulele", "writing short stories", "blogging", "songwriting", "acting",
        "doing stand-up comedy", "performing magic tricks", "building sandcastles", "video editing", "graphic design",
        "embroidery", "crocheting", "quilting", "scrapbooking", "candle making", "soap making", "jewelry making",
        "glassblowing", "leatherworking", "building model airplanes", "playing board games", "geocaching",
        "orienteering", "growing bonsai trees", "flower arranging", "cake decorating", "making homemade pasta",
        "meal prepping", "training a dog", "playing water polo", "taking road trips", "traveling solo", "skydiving",
        "paragliding", "playing cricket", "playing rugby", "playing ultimate frisbee", "beatboxing", "coin collecting",
        "stamp collecting", "blacksmithing", "furniture restoration", "writing letters by hand", "snowshoeing",
        "tutoring", "hosting a book club", "hosting dinner parties", "fossil hunting", "metal detecting",
    ),
    "place": (
        "Kyoto", "Florence", "Milan", "Naples", "Munich", "Edinburgh", "Copenhagen", "Oslo", "Warsaw", "Krakow",
        "Athens", "Marrakech", "Dubrovnik", "Switzerland", "Brussels", "Seville", "Porto", "Salzburg", "Zurich",
        "Tallinn", "Bangkok", "Hanoi", "Bali", "the Philippines", "Malaysia", "Sri Lanka", "Mumbai", "Jaipur",
        "Shanghai", "Vancouver", "Toronto", "Montreal", "San Francisco", "Chicago", "New Orleans", "Boston",
        "Rio de Janeiro", "Patagonia", "Colombia", "Costa Rica", "the Galapagos Islands", "Uruguay", "Tanzania",
        "Madagascar", "Namibia", "Ghana", "Botswana", "Ireland", "Wales", "Cornwall", "the Lake District", "Sicily",
        "the Amalfi Coast", "Provence", "the Rocky Mountains", "Cambodia", "Fiji", "Tasmania", "Melbourne",
        "the Maldives", "Finland", "Denmark", "Poland", "Cappadocia", "Oaxaca", "Havana", "Jamaica", "Malta", "Crete",
        "Slovenia",
    ),
    "job": (
        "a lifeguard", "an air traffic controller", "a physical therapist", "a makeup artist", "a fashion designer",
        "an interior designer", "a construction worker", "a bricklayer", "a roofer", "a welder", "a locksmith",
        "a truck driver", "a train conductor", "a travel agent", "a hotel manager", "a receptionist", "a waiter",
        "a barista", "a butcher", "a cashier", "a real estate agent", "an economist", "a historian", "an archaeologist",
        "a geologist", "a marine biologist", "a meteorologist", "an astronomer", "a school principal",
        "a school counselor", "an editor", "a novelist", "a copywriter", "a radio host", "a film director", "an actor",
        "a dancer", "a sculptor", "an animator", "an auctioneer", "a lab technician", "a dog groomer", "an arborist",
        "a security guard", "a city planner", "a surveyor", "a cartographer", "an event planner", "a caterer",
        "a piano tuner", "a watchmaker", "a jeweler", "a shoemaker", "a stonemason", "a warehouse worker", "a janitor",
        "a nanny", "a personal trainer", "a driving instructor", "a project manager",
    ),
    "idea": (
        "humility", "forgiveness", "resilience", "optimism", "generosity", "responsibility", "loyalty", "perseverance",
        "critical thinking", "the sharing economy", "bilingualism", "standardized testing", "taking a gap year",
        "urbanization", "the Silk Road", "the Roman Empire", "Stoicism", "the golden rule", "the Enlightenment",
        "supply and demand", "inflation", "opportunity cost", "confirmation bias", "a growth mindset",
        "delayed gratification", "procrastination", "work-life balance", "cybersecurity", "automation", "biodiversity",
        "wildlife conservation", "water conservation", "vegetarianism", "the circular economy", "the gig economy",
        "sportsmanship", "competition", "tradition", "etiquette", "punctuality", "hospitality", "storytelling",
        "active listening", "negotiation", "compromise", "trust", "ambition", "wisdom", "a sense of humor", "boredom",
        "solitude", "nostalgia", "happiness", "hope", "Pride and Prejudice", "Don Quixote", "the Odyssey", "Macbeth",
        "the Age of Exploration", "the alphabet", "the metric system", "daylight saving time",
        "the Pythagorean theorem", "probability", "game theory", "modern art", "street art", "advertising",
        "rural life", "handwriting",
    ),
    "food": (
        "minestrone", "chicken noodle soup", "gazpacho", "clam chowder", "French onion soup", "butternut squash soup",
        "borscht", "pho", "biryani", "butter chicken", "shakshuka", "tabbouleh", "baba ganoush", "moussaka",
        "spanakopita", "bruschetta", "focaccia", "gnocchi", "tiramisu", "panna cotta", "macaroni and cheese",
        "meatloaf", "shepherd's pie", "fish and chips", "a hamburger", "cornbread", "jambalaya", "gumbo",
        "chicken pot pie", "potato salad", "a quesadilla", "ceviche", "an empanada", "feijoada", "bibimbap", "kimchi",
        "bulgogi", "tempura", "teriyaki chicken", "mapo tofu", "Peking duck", "kung pao chicken", "chicken satay",
        "beef rendang", "jollof rice", "shawarma", "baklava", "ratatouille", "quiche Lorraine", "beef bourguignon",
        "coq au vin", "goulash", "schnitzel", "cheesecake", "avocado toast", "eggs Benedict", "a cinnamon roll",
        "a poke bowl", "shrimp scampi", "mochi",
    ),
    "animal": (
        "leopards", "cheetahs", "jaguars", "hyenas", "rhinos", "hippos", "chimpanzees", "orangutans", "lemurs",
        "sloths", "armadillos", "anteaters", "porcupines", "raccoons", "skunks", "badgers", "moose", "bison", "llamas",
        "meerkats", "hamsters", "guinea pigs", "platypuses", "wombats", "walruses", "narwhals", "manatees", "sheep",
        "pigs", "ducks", "geese", "turkeys", "pigeons", "sparrows", "woodpeckers", "peacocks", "ostriches", "pelicans",
        "puffins", "vultures", "falcons", "storks", "seahorses", "clownfish", "stingrays", "eels", "lobsters", "squid",
        "snakes", "tortoises", "salamanders", "ladybugs", "grasshoppers", "dragonflies", "fireflies", "beetles",
        "donkeys", "mice", "coyotes", "praying mantises",
    ),
    "task": (
        "my landlord asking to renew my lease", "a restaurant booking a table for a birthday dinner",
        "my neighbor asking them to water my plants while I am away", "my colleagues announcing my retirement",
        "a former boss asking for a reference", "my child's school explaining an absence",
        "an airline about lost luggage", "a car repair shop asking about the status of my car",
        "my gym asking to cancel my membership", "a wedding photographer asking about their availability",
        "my friends inviting them to a housewarming party", "a bookstore asking if a book is back in stock",
        "my team welcoming a new colleague", "a local newspaper suggesting a story idea",
        "a museum asking about group tickets", "my brother thanking him for helping me move",
        "a moving company asking for a price estimate", "a hiring manager following up after an interview",
        "my parents inviting them to visit for the holidays", "a coworker apologizing for missing a meeting",
        "an online store about a damaged package", "a hotel thanking them for a wonderful stay",
        "a library asking to extend a book loan", "an event organizer offering to volunteer",
        "my team reminding them about a deadline", "a customer thanking them for their feedback",
        "my cousin congratulating her on her wedding", "a tour company asking about a trip for a large group",
        "a pet sitter with instructions for feeding my dog", "the school principal proposing a charity bake sale",
        "a vet clinic asking to book a checkup for my cat", "a supplier asking about a delayed order",
        "my building manager reporting a leak in the ceiling", "a job candidate inviting them to an interview",
        "my neighbors about a lost cat", "a contractor asking about the progress of a kitchen renovation",
        "a teacher thanking them at the end of the school year", "a utility company about an unusually high bill",
        "my old classmates organizing a reunion", "a conference organizer asking to present a talk",
    ),
}

# 600 topics more (2026-12-06), written to fit every template of their kind
THIRD_TOPICS = {
    "object": (
        "bread maker", "dehumidifier", "garbage disposal", "kitchen timer", "pepper grinder", "coffee grinder",
        "food dehydrator", "deep fryer", "pizza oven", "cast iron skillet", "rolling pin", "cheese grater",
        "salad spinner", "garlic press", "mortar and pestle", "wrench", "handsaw", "soldering iron", "workbench",
        "toolbox", "padlock", "baby monitor", "bathroom scale", "water pump", "GPS receiver", "walkie-talkie",
        "telephone", "cassette player", "jukebox", "gramophone", "synthesizer", "clarinet", "trombone", "mandolin",
        "tambourine", "pipe organ", "harpsichord", "fishing rod", "snorkel", "wetsuit", "life jacket", "surfboard",
        "sled", "rowboat", "hovercraft", "glider", "blimp", "cable car", "bulldozer", "forklift", "fire truck",
        "wheelchair", "hearing aid", "weather vane", "rain gauge", "seismograph", "Geiger counter", "barcode scanner",
        "credit card", "parking meter", "revolving door", "smart speaker", "game console", "joystick", "smartwatch",
        "fitness tracker", "power bank", "windmill", "chandelier", "rocking chair", "bunk bed", "mattress",
        "snow globe", "piggy bank", "pogo stick", "Ferris wheel", "roller coaster", "bird feeder", "beehive",
        "scarecrow", "combine harvester", "watering can", "rake", "paintbrush", "easel", "pottery wheel", "kiln",
        "ballpoint pen", "filing cabinet", "photocopier",
    ),
    "nature": (
        "sleet", "a dust devil", "a tidal bore", "a red tide", "a blue moon", "a harvest moon", "a sun dog",
        "the green flash at sunset", "a shooting star", "the solar wind", "a geomagnetic storm", "the Earth's rotation",
        "a breaking wave", "a riptide", "a hot spring", "coral bleaching", "ocean acidification", "sea level rise",
        "glacier calving", "sea ice", "lake-effect snow", "a sea breeze", "a temperature inversion", "a cloudburst",
        "a flash flood", "the rainy season", "the spring bloom", "seed germination", "transpiration", "osmosis",
        "a hiccup", "shivering", "blushing", "getting goosebumps", "forgetting", "hunger", "thirst", "color vision",
        "an optical illusion", "a shadow", "thunder", "condensation", "boiling", "star formation",
        "a planetary alignment", "the spring equinox", "a moonrise", "the migration of wildebeest", "the salmon run",
        "a locust swarm", "molting", "seed dispersal", "ecological succession", "the smell of rain",
        "the formation of stalactites", "cellular respiration", "genetic inheritance", "a heartbeat", "breathing",
        "pollen season", "the circadian rhythm", "a fairy ring", "an aftershock", "a volcanic winter", "radioactivity",
        "inertia", "air pressure", "surface tension", "capillary action", "the color of the ocean",
    ),
    "activity": (
        "playing the flute", "playing the cello", "playing the saxophone", "playing the trumpet", "playing darts",
        "playing pool", "playing pickleball", "playing card games", "trail running", "open-water swimming",
        "windsurfing", "kitesurfing", "white-water rafting", "canoeing", "bouldering", "ice climbing", "mountaineering",
        "caving", "backpacking", "cross-country skiing", "curling", "fly fishing", "disc golf",
        "training for a triathlon", "kickboxing", "karate", "ballroom dancing", "ballet", "watercolor painting",
        "drawing comics", "bookbinding", "weaving", "cross-stitch", "printmaking", "wood carving",
        "building model railways", "fermenting vegetables", "making jam", "baking pastries", "barbecuing",
        "growing herbs indoors", "caring for houseplants", "raising chickens", "keeping an aquarium",
        "learning sign language", "touch typing", "writing a novel", "debating", "doing improv", "puppetry",
        "producing music", "learning music theory", "singing karaoke", "wildlife photography", "beachcombing",
        "flying kites", "model rocketry", "budgeting", "doing home repairs", "maintaining a car", "learning to drive",
        "fostering rescue animals", "mentoring", "studying abroad", "running a small business", "screenwriting",
        "tree climbing", "memorizing poetry", "mental math", "astrophotography", "shell collecting", "judo",
    ),
    "place": (
        "Lyon", "Bordeaux", "Hamburg", "Cologne", "Bruges", "Geneva", "Innsbruck", "Bologna", "Verona", "Granada",
        "Valencia", "Bergen", "Reykjavik", "Riga", "Ljubljana", "Tbilisi", "the Isle of Skye", "York", "Oxford",
        "the Cotswolds", "Tuscany", "Sardinia", "Santorini", "Mallorca", "the Canary Islands", "the Azores", "Normandy",
        "Croatia", "Montenegro", "Romania", "the Faroe Islands", "Osaka", "Hiroshima", "Hokkaido", "Taipei", "Busan",
        "Beijing", "Delhi", "Kerala", "Kathmandu", "Chiang Mai", "Luang Prabang", "Ho Chi Minh City", "Kuala Lumpur",
        "Bhutan", "Samarkand", "Dubai", "Oman", "Zanzibar", "Nairobi", "Ethiopia", "Senegal", "Mauritius",
        "the Serengeti", "Victoria Falls", "Quebec City", "Banff", "Seattle", "Los Angeles", "Nashville", "Yosemite",
        "the Florida Keys", "Puerto Rico", "Guatemala", "Ecuador", "Machu Picchu", "Cartagena", "Easter Island",
        "Queenstown", "Tahiti",
    ),
    "job": (
        "a midwife", "a dental hygienist", "an optometrist", "a speech therapist", "an occupational therapist",
        "a dietitian", "a family doctor", "a sign language interpreter", "a court reporter", "a paralegal",
        "an insurance agent", "a financial planner", "an actuary", "a statistician", "a chemist", "a botanist",
        "an entomologist", "a volcanologist", "an oceanographer", "a forester", "a beekeeper", "a cheesemaker",
        "a pastry chef", "a food critic", "a shepherd", "a rancher", "a dog trainer", "a farrier", "a blacksmith",
        "a potter", "a tattoo artist", "a hairdresser", "a tour guide", "a ski instructor", "an archivist",
        "a museum curator", "an illustrator", "a UX designer", "a video game tester", "a robotics engineer",
        "a civil engineer", "a taxi driver", "a delivery driver", "a lighthouse keeper", "a customs officer",
        "a diplomat", "a news anchor", "a sports commentator", "a stunt performer", "a voice actor", "a puppeteer",
        "a choreographer", "a composer", "a sound engineer", "a playwright", "a proofreader", "a bookseller",
        "a recruiter", "a landscaper", "a chimney sweep", "a glazier", "an emergency dispatcher",
    ),
    "idea": (
        "integrity", "compassion", "respect", "fairness", "mindfulness", "cooperation", "frugality", "altruism",
        "tolerance", "open-mindedness", "accountability", "peer pressure", "first impressions", "goal setting",
        "decision making", "trial and error", "cause and effect", "scarcity", "compound interest",
        "the division of labor", "free trade", "the stock market", "entrepreneurship", "self-driving cars",
        "virtual reality", "3D printing", "online shopping", "digital literacy", "machine translation",
        "the invention of the wheel", "the invention of writing", "the germ theory of disease", "the periodic table",
        "Newton's laws of motion", "the Stone Age", "the Middle Ages", "the Viking Age", "the Maya civilization",
        "the moon landing", "the Magna Carta", "Moby-Dick", "Frankenstein", "Jane Eyre", "War and Peace",
        "A Christmas Carol", "Gulliver's Travels", "the Iliad", "A Midsummer Night's Dream", "Aesop's fables",
        "public libraries", "school uniforms", "hands-on learning", "homeschooling", "car-free cities",
        "high-speed rail", "tiny homes", "plastic pollution", "food waste", "light pollution", "deforestation",
        "fair trade", "body language", "small talk", "the bystander effect", "the butterfly effect", "citizen science",
        "free will", "the trolley problem", "jazz", "opera", "Impressionism", "Greek mythology",
    ),
    "food": (
        "lentil soup", "split pea soup", "tom yum soup", "wonton soup", "chicken tikka masala", "palak paneer",
        "chana masala", "samosas", "naan bread", "okonomiyaki", "katsu curry", "onigiri", "udon", "gyoza", "tteokbokki",
        "Korean fried chicken", "congee", "scallion pancakes", "nasi goreng", "laksa", "a banh mi", "Thai green curry",
        "chicken adobo", "lamb kofta", "fattoush", "stuffed grape leaves", "a chicken tagine", "peri-peri chicken",
        "a Spanish omelette", "patatas bravas", "churros", "Portuguese custard tarts", "cacio e pepe", "arancini",
        "polenta", "cannoli", "gelato", "crepes", "a croque monsieur", "bouillabaisse", "creme brulee", "macarons",
        "sauerkraut", "pretzels", "apple strudel", "Swedish meatballs", "beef stroganoff", "scones",
        "sticky toffee pudding", "a Cornish pasty", "pulled pork", "a lobster roll", "corn on the cob", "key lime pie",
        "pecan pie", "brownies", "enchiladas", "pupusas", "tres leches cake", "hash browns", "a Caesar salad",
        "rice pudding",
    ),
    "animal": (
        "alpacas", "yaks", "reindeer", "antelopes", "gazelles", "wildebeest", "warthogs", "baboons", "gibbons",
        "red pandas", "lynxes", "cougars", "polar bears", "sea lions", "orcas", "pufferfish", "goldfish", "starfish",
        "sea urchins", "oysters", "cuttlefish", "robins", "magpies", "ravens", "kingfishers", "herons", "albatrosses",
        "seagulls", "toucans", "emus", "hawks", "condors", "swallows", "iguanas", "geckos", "chameleons",
        "Komodo dragons", "alligators", "toads", "newts", "termites", "mosquitoes", "wasps", "bumblebees", "moths",
        "crickets", "cicadas", "earthworms", "scorpions", "chipmunks", "prairie dogs", "opossums", "wallabies",
        "Tasmanian devils", "echidnas", "hares", "ferrets", "mongooses", "aardvarks", "wild boars", "chinchillas",
        "gerbils",
    ),
    "task": (
        "my landlord asking if I can paint the walls", "a neighbor asking them to move their car from my driveway",
        "my child's coach thanking them for a great season", "my new team introducing myself",
        "my tenants about a planned water shutoff", "my dentist's office asking to reschedule a cleaning",
        "a school asking about enrolling my son", "an old friend apologizing for losing touch",
        "a colleague congratulating them on a promotion", "my manager asking to work from home on Fridays",
        "a recruiter declining a job offer", "my team sharing the results of a survey",
        "a friend apologizing for returning a borrowed book late", "a neighbor thanking them for shoveling my sidewalk",
        "a host thanking them for a lovely dinner party", "my wedding guests with directions to the venue",
        "a food bank asking what donations they need", "a swimming school asking about lessons for my kids",
        "my internet provider about a slow connection", "my insurance company about a claim for storm damage",
        "my homeowners association asking about building a fence", "a new client welcoming them aboard",
        "our customers explaining a price increase", "a colleague giving feedback on their presentation",
        "my study group planning our next session", "a university asking about the status of my application",
        "a scholarship committee thanking them for the award", "a campsite asking about booking a spot for a week",
        "a car dealership asking about a test drive", "my neighbors inviting them to a street party",
        "my book club suggesting our next book", "a friend wishing them a speedy recovery",
        "my parents telling them about my new job", "my grandfather thanking him for a birthday gift",
        "a pen pal in another country", "a local farmer asking to buy fresh eggs",
        "a theater asking about wheelchair seating", "the parking office appealing a parking ticket",
        "the city office asking about a permit for a yard sale", "a babysitter with the plan for Saturday night",
    ),
}

TOPIC_EDITIONS = (FIRST_TOPICS, SECOND_TOPICS, THIRD_TOPICS)
TOPICS = {kind: tuple(topic for edition in TOPIC_EDITIONS for topic in edition.get(kind, ())) for kind in TEMPLATES}

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
    """Every request of `split` ("train" or "held_out"), each edition's shuffled by `seed` after the
    earlier editions'."""
    prompts = []
    for number, edition in enumerate(TOPIC_EDITIONS):
        requests = [template.format(topic) for kind, topics in edition.items() for topic in topics
                    if topic_split(topic) == split for template in TEMPLATES[kind]]
        random.Random(f"open-prompts-{split}-{seed}" + (f"-edition-{number}" if number else "")).shuffle(requests)
        prompts += requests
    return prompts
