"""The small task families the built-in model is trained and evaluated on.

Each family yields chat exchanges ``(question, answer)`` with varied natural phrasings and a
short, exact answer: the bare result, no sentence around it (``"42"``, ``"tenalp"``,
``"apple, fig, pear"``), so evaluation is exact match on the stripped reply.
``generate(family, n, seed)`` is deterministic: the same arguments give the same list on every
machine and Python version (``random.Random`` seeded with a string is hash-seed independent).
The training corpus (``scripts/train_builtin.py``) and the evaluation (``dllm eval``) draw from
the same generator with different seeds. Training questions are composed (lead-in, frame,
operand phrasing, closing, casing and punctuation noise; words sometimes Capitalised or in
CAPITALS, so sorting ignores case and counting a letter counts it in either case).
``held_out=True`` asks in other words: templates training never produces (by ``skeleton``),
designed ones and natural ones written without seeing the training phrasings -- how the model
copes with phrasings it was not trained on.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

TRAIN_SEED = 0
EVAL_SEED = 20250611  # never used for training

# A few hundred common English words, lowercase, 3-8 letters (sorting uses those of 3-6).
WORDS: tuple[str, ...] = tuple(
    """
    able acid aged also area army away baby back ball band bank base bath bear beat bell belt
    best bird blow blue boat body bone book born boss both bowl bread brick bridge bright brown
    build burn busy cake call calm camp card care cart case cash cast cat chain chair chalk
    cheap check chess chief child city claim class clean clear clock cloud coach coast coat
    code cold color cook cool copy corn cost cotton cover crab cream crowd crown cup cycle
    dance dark date dawn deal deep desk dial diet dirt dish dog door dose dream dress drink
    drive drop drum duck dust eagle early earth east easy edge egg eight empty enemy enjoy
    equal event exam extra face fact fair farm fast father field fifty film find fine fire
    fish five flag flat floor flour flow flower fog fold food foot force forest fork form fox
    frame fresh friend frog fruit full fun game garden gate gift girl glad glass glove goal
    goat gold good grape grass great green grey group guard guest guide hair half hall hand
    happy hard harm hat head heart heat heavy help hero high hill home honey hope horse hotel
    hour house human ice idea inch iron island jacket jam job join joke juice jump key kid king
    kite knee knife lake lamp land large last late laugh lawn leaf left lemon letter level
    life light lime line lion list live lock long loud love lucky lunch magic mail main map
    march mark market mask meal meat melon metal milk mind mint model money month moon motor
    mouse mouth music nail name nest never night noise north nose note ocean offer oil old
    olive onion open orange order owl page paint pair paper park party pasta path peace peach
    pear pen pencil pepper piano pilot pink pipe plan planet plant plate plum pocket point
    pond pool potato power price print prize pump queen quick quiet rabbit radio rain river
    road robot rock roof room root rope rose round ruler salad salt sand scale school sea seed
    shape sheep shell ship shirt shoe shop short silver simple singer sister skirt sky sleep
    slow small smile snake snow soap sock soft song soup south space spoon spring square stamp
    star steam stone storm story street sugar summer sun swan sweet table tail taxi tea team
    tent tiger time toast today tomato tooth towel tower town toy train tree truck tulip
    turtle uncle union upper valley van vase violin voice wall warm watch water wave wheel
    whale white wind window wine winter wolf wood word world yard yellow young zebra zero zoo
    apple banana fig kiwi mango cherry
    animal balloon blanket bicycle cabbage captain chicken diamond dolphin elephant evening
    example feather holiday husband kitchen ladder library machine monkey morning mountain
    network officer orchard package pattern picture pumpkin rainbow sandwich science sunset
    teacher thunder umbrella unicorn village weather whisper yogurt
    """.split()
)
SHORT_WORDS: tuple[str, ...] = tuple(w for w in WORDS if len(w) <= 6)

Exchange = tuple[str, str]


def _number(rng: random.Random) -> int:
    """0-999, with 1-, 2- and 3-digit numbers equally likely."""
    digits = rng.randint(1, 3)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


# ---------------------------------------------------------------------------------------------
# Phrasings. Training questions are composed: a courtesy lead-in (sometimes), a core template
# (a frame crossed with the ways of naming its operands), a closing word (sometimes), then
# surface noise (lowercase, no final mark). The held-out templates (further below) are whole
# questions that training never produces: every composed question whose skeleton -- lowercase,
# punctuation and courtesy words dropped -- equals a held-out template's skeleton is drawn again.
# ---------------------------------------------------------------------------------------------

LEAD_INS = (
    "Hey, ", "Hi, ", "Hello, ", "Hi! ", "Hey there, ", "Quick question: ", "Question: ",
    "Quick one: ", "OK, ", "Okay, ", "So, ", "Please, ", "Hi there! ", "Help me out: ",
    "I have a question. ", "Can you help? ", "Hmm, ", "Tell me, ", "Um, ", "Excuse me, ",
    "Good morning! ", "Hey! ", "Dear assistant, ", "Hi, quick one: ", "Hello! Question: ",
    "OK so ", "Hey, so ",
)
CLOSINGS = (" please", ", please", " please?", ". Thanks", ", thanks!", " thanks", " for me",
            " :)", "??", "!", " quickly")
# Dropped from both sides before comparing a question with the held-out templates.
COURTESY = frozenset("please kindly hey hi hello there thanks thank you ok okay so quick question "
                     "one tell me can help hmm i have a out".split())
# Instructions people add after a question, by the kind of answer (never changing the answer).
NUMBER_TAILS = (", just the number", " - just the number", " (just the answer)", ", answer only",
                " and give me the answer", " and tell me the result", ", only the result",
                ". Reply with the number only", ", no explanation", " - number only",
                ", what do you get", ", what is the answer")
WORD_TAILS = (", just the answer", " - answer only", " (only the answer)", ", no explanation",
              " and give me the result", ", only the result", " and tell me the answer",
              ". Reply with the answer only", ", what do you get")
LIST_TAILS = WORD_TAILS + (", separated by commas", ", with commas between them",
                           " and keep the commas", ", as a list")


def skeleton(template: str) -> str:
    """The words of ``template`` that carry its meaning: lowercase, placeholders kept, ``+``,
    ``-`` and ``{op}`` one word ``op``, ``=`` kept, "what's" is "what is" (and any "word's" is
    "word is"; "{c}'s" and "{c}s" are "{c}"), every other non-letter a space, courtesy words
    dropped."""
    text = re.sub(r"\{(\w+)\}", r" _\1_ ", template.lower()).replace("_op_", "+")
    text = re.sub(r"\bwhat'?s\b", "what is", text)
    text = re.sub(r"\b([a-z]{2,})'s\b", r"\1 is", text)  # "number's bigger"
    text = re.sub(r"_c_ '?s\b", "_c_", text)  # "{c}'s" and "{c}s" are "{c}"
    text = re.sub(r"\s*([-+=])\s*", r" \1 ", text).replace("+", "op").replace(" - ", " op ")
    return " ".join(w for w in re.sub(r"[^a-z_=]+", " ", text).split() if w not in COURTESY)


def _expand(frames: tuple[str, ...], slots: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """Every frame with each ``<NAME>`` replaced by every phrase of ``slots[NAME]``."""
    out: list[str] = []
    for frame in frames:
        todo = [frame]
        for name, phrases in slots.items():
            todo = [t.replace(f"<{name}>", p) for t in todo for p in phrases] if (
                f"<{name}>" in frame) else todo
        out += todo
    return tuple(dict.fromkeys(out))


def _capitalize_first(text: str) -> str:
    return text[0].upper() + text[1:] if text and text[0].islower() else text


def _compose(rng: random.Random, cores: tuple[str, ...], forbidden: frozenset[str],
             tails: tuple[str, ...] = ()) -> str:
    """One training question template: lead-in, core, an instruction tail (sometimes, from
    ``tails``), closing, surface noise; never one whose skeleton is a held-out template's."""
    while True:
        core = rng.choice(cores)
        if tails and rng.random() < 0.1:
            end = core[-1] if core[-1] in ".?!" else ""
            core = core.rstrip(".?!") + rng.choice(tails) + end
        text = core
        if rng.random() < 0.3:
            lead = rng.choice(LEAD_INS)
            text = lead + (core[0].lower() + core[1:] if rng.random() < 0.7 else core)
        if rng.random() < 0.12:
            text = text.rstrip(".?!") + rng.choice(CLOSINGS)
        r = rng.random()
        if r < 0.08:
            text = text.lower()
        elif r < 0.2:
            text = text[0].lower() + text[1:]
        if rng.random() < 0.15 and text[-1] in ".?!":
            text = text[:-1]
        if skeleton(text) not in forbidden:
            return text


def _held_out(rng: random.Random, templates: tuple[str, ...]) -> str:
    text = rng.choice(templates)
    if rng.random() < 0.15:
        text = text[0].lower() + text[1:]
    if rng.random() < 0.15 and text[-1] in ".?":
        text = text[:-1]
    return text


def _cased(rng: random.Random, word: str) -> str:
    """A word as people type it: mostly lowercase, sometimes Capitalised, rarely in CAPITALS
    (sorting then ignores case, and counting a letter counts it in either case)."""
    r = rng.random()
    return word.capitalize() if r < 0.2 else word.upper() if r < 0.28 else word


def _numbers(rng: random.Random, a: int, b: int) -> dict[str, str]:
    """The operands as a training question shows them: sometimes both in quotes."""
    q = rng.choice(("'", '"')) if rng.random() < 0.06 else ""
    return {"a": f"{q}{a}{q}", "b": f"{q}{b}{q}"}


def _op(rng: random.Random, sign: str) -> str:
    return sign if rng.random() < 0.5 else f" {sign} "


# --- add -------------------------------------------------------------------------------------
_ASK = ("What is <E>?", "What's <E>?", "Whats <E>", "what is <E>", "Compute <E>.",
        "Calculate <E>.", "Work out <E>.", "Evaluate <E>.", "Find <E>.", "Tell me <E>.",
        "Give me <E>.", "Can you compute <E>?", "Could you calculate <E>?",
        "Can you tell me <E>?", "How much is <E>?", "What does <E> equal?",
        "What does <E> come to?", "<E> = ?", "<E> =", "<E>", "<E>?", "<E> is?",
        "<E> equals?", "<E> equals what?", "What do you get for <E>?", "I need <E>.",
        "Do you know <E>?", "What number is <E>?", "What is the value of <E>?",
        "Result of <E>?", "Solve <E>.", "What's the answer to <E>?", "Figure out <E>.")
ADD_PHRASES = _expand(_ASK, {"E": (
    "{a}{op}{b}", "{a} plus {b}", "the sum of {a} and {b}", "the total of {a} and {b}",
    "{a} added to {b}", "{a} and {b} added together", "{a} plus {b} together")}) + (
    "Add {a} and {b}.", "Add {a} to {b}.", "Add {a} plus {b}.", "Add up {a} and {b}.",
    "Sum {a} and {b}.", "Sum of {a} and {b}?", "Total of {a} and {b}?",
    "Can you add {a} and {b}?", "Could you add {a} to {b}?",
    "If you add {a} and {b}, what do you get?", "If I add {a} to {b}, what do I get?",
    "What do you get when you add {a} and {b}?", "What do {a} and {b} add up to?",
    "What do {a} and {b} make?", "What do {a} and {b} make together?",
    "{a} and {b} together make what?", "How much are {a} and {b} together?",
    "What is the result of {a}{op}{b}?", "What is {a} and {b} added together?",
    "Add these numbers: {a} and {b}", "Add these: {a}, {b}", "Plus {a} and {b}?",
    "What is {a} more than {b}?", "Increase {a} by {b}.", "{a} increased by {b} is?",
    "The sum: {a}{op}{b}", "Sum: {a}{op}{b}", "{a} plus {b} is what?")

# The grammar above was written before the natural held-out templates were seen (``_*_FIRST``
# keeps it: what it covers is what a natural template counts as trained against). The frames
# added below each family came after, from the failure modes of the first model on held-out
# questions (words next to the operands taken for operands, quoted numbers, instruction tails);
# training still never produces a held-out template (by skeleton).
# More ways to ask, composed from a verb, the operands named in some way and a question form.
_ADD_FIRST = ADD_PHRASES
_TWO = ("{a} and {b}", "the numbers {a} and {b}", "the two numbers {a} and {b}",
        "these two numbers: {a} and {b}", "these numbers: {a}, {b}", "{a} with {b}")
ADD_PHRASES += _expand((
    "Add <N>.", "Add up <N>.", "Sum up <N>.", "Total <N>.", "Combine <N>.", "Please add <N>.",
    "Add together <N>.", "Find the sum of <N>.", "Give me the sum of <N>.", "Get the total of <N>.",
    "What is the sum of <N>?", "What's the total of <N>?", "What do you get adding <N>?",
    "How much do you get if you add <N>?", "What is the total when you add <N>?",
    "Work out the sum of <N>.", "Compute the total of <N>.", "Tell me the total of <N>.",
    "Add <N> together.", "Add <N> and tell me the total.", "Sum of <N>, please.",
), {"N": _TWO}) + (
    "If I have {a} and get {b} more, how many is that?", "I have {a} and get {b} more. How many now?",
    "{a} and {b} more is?", "Start with {a} and add {b}.", "What is {b} added to {a}?",
    "Take {a} and add {b}.", "{a}, add {b}.", "{a} + {b} gives?", "{a} plus {b} gives what?",
    "What number do you get from {a} plus {b}?", "Calculate the sum {a}{op}{b}.",
    "Addition: {a}{op}{b}", "Add: {a}, {b}", "Work this out: {a}{op}{b}", "Quick math: {a}{op}{b}",
    "Math question: what is {a}{op}{b}?", "Answer this: {a}{op}{b}", "What is {a}{op}{b} equal to?",
    "Compute {a}{op}{b} for me.", "What does {a}{op}{b} give?", "What's {a}{op}{b} again?",
    "Sum these two: {a} and {b}", "{a} plus {b}, what is it?", "{a}{op}{b}, what is it?",
)

# --- sub -------------------------------------------------------------------------------------
SUB_PHRASES = _expand(_ASK, {"E": (
    "{a}{op}{b}", "{a} minus {b}", "{a} take away {b}", "{a} less {b}",
    "the difference between {a} and {b}", "{b} subtracted from {a}", "{a} with {b} taken away",
    "{b} taken from {a}", "{a} minus {b} exactly")}) + (
    "Subtract {b} from {a}.", "Take {b} away from {a}.", "Take {b} from {a}.",
    "Deduct {b} from {a}.", "Remove {b} from {a}.", "Can you subtract {b} from {a}?",
    "Could you take {b} away from {a}?", "If you subtract {b} from {a}, what do you get?",
    "If I take {b} from {a}, what is left?", "What do you get when you take {b} from {a}?",
    "What is left when you take {b} away from {a}?", "How much is left when {b} is taken from {a}?",
    "What remains if you subtract {b} from {a}?", "{a} minus {b} is what?",
    "Decrease {a} by {b}.", "{a} decreased by {b} is?", "{a} reduced by {b}?",
    "What is {a} reduced by {b}?", "Subtract: {a}{op}{b}", "The difference: {a}{op}{b}",
    "Difference of {a} and {b}?", "What's {b} less than {a}?", "Minus {b} from {a}?",
    "Start with {a} and subtract {b}.", "From {a}, subtract {b}.", "From {a} take away {b}.")

_SUB_FIRST = SUB_PHRASES
SUB_PHRASES += (
    "What is the difference of {a} and {b}?", "What do you get if you subtract {b} from {a}?",
    "Take away {b} from {a}.", "How much is {a} take away {b}?",
    "If I have {a} and lose {b}, how many are left?", "I had {a} and gave away {b}. How many are left?",
    "{a} minus {b} gives?", "{a} less {b} is?", "What's left after taking {b} from {a}?",
    "Subtract {b} out of {a}.", "Please subtract {b} from {a}.", "Find the difference {a}{op}{b}.",
    "Work out {a} minus {b}.", "Compute the difference of {a} and {b}.",
    "Tell me {a} minus {b}.", "Give me {a} minus {b}.", "Subtraction: {a}{op}{b}",
    "Work this out: {a}{op}{b}", "Quick math: {a}{op}{b}", "Math question: what is {a}{op}{b}?",
    "Answer this: {a}{op}{b}", "What is {a}{op}{b} equal to?", "Compute {a}{op}{b} for me.",
    "What does {a}{op}{b} give?", "What's {a}{op}{b} again?", "{a} minus {b}, what is it?",
    "{a}{op}{b}, what is it?", "{a}{op}{b} gives?", "What number do you get from {a} minus {b}?",
    "Start at {a} and take away {b}.", "Remove {b} from {a}. What is left?",
    "How much is left if you subtract {b} from {a}?", "What remains when {b} is taken from {a}?",
    "Subtract {b} from {a} and tell me the result.", "If {b} is taken from {a}, what is left?",
    "Take {b} off {a}.", "{a} take {b}?", "From {a} remove {b}.", "Minus {b} from {a}, please.",
)

# --- compare ---------------------------------------------------------------------------------
_WHICH = ("Which is <P>, {a} or {b}?", "Which is <P>: {a} or {b}?", "Which is <P> {a} or {b}",
          "Which number is <P>, {a} or {b}?", "Which one is <P>, {a} or {b}?",
          "Which of {a} and {b} is <P>?", "Which of these is <P>: {a} or {b}?",
          "{a} or {b}, which is <P>?", "{a} or {b}: which is <P>?", "{a} or {b} - which is <P>?",
          "Between {a} and {b}, which is <P>?", "Of {a} and {b}, which is <P>?",
          "Is {a} or {b} <P>?", "Which is <P>? {a} or {b}", "Which value is <P>, {a} or {b}?",
          "Out of {a} and {b}, which one is <P>?")
_THE = ("What is the <A> of {a} and {b}?", "Give the <A> of {a} and {b}.",
        "Give me the <A> of {a} and {b}.", "Tell me the <A> of {a} and {b}.",
        "The <A> of {a} and {b}?", "Find the <A> of {a} and {b}.",
        "Pick the <A> number: {a} or {b}", "Choose the <A> one: {a} or {b}",
        "Which is the <A> number, {a} or {b}?", "What's the <A> number, {a} or {b}?",
        "Name the <A> of {a} and {b}.", "Return the <A> of {a} and {b}.")
LARGER_PHRASES = _expand(_WHICH, {"P": ("larger", "bigger", "greater", "higher", "more",
                                        "the larger one", "the bigger number")}) + _expand(
    _THE, {"A": ("larger", "bigger", "greater", "higher", "largest", "biggest")}) + (
    "max({a}, {b})", "max({a},{b})", "max of {a} and {b}", "maximum of {a} and {b}",
    "What is the maximum of {a} and {b}?", "Which is the max, {a} or {b}?")
SMALLER_PHRASES = _expand(_WHICH, {"P": ("smaller", "less", "lower", "the smaller one",
                                         "the smaller number", "the lower number")}) + _expand(
    _THE, {"A": ("smaller", "lower", "lesser", "smallest", "lowest")}) + (
    "min({a}, {b})", "min({a},{b})", "min of {a} and {b}", "minimum of {a} and {b}",
    "What is the minimum of {a} and {b}?", "Which is the min, {a} or {b}?")

_LARGER_FIRST = LARGER_PHRASES
_SMALLER_FIRST = SMALLER_PHRASES
_VS = ("{a} or {b}", "{a} vs {b}", "{a} versus {b}", "{a}, {b}", "these two numbers: {a}, {b}",
       "the numbers {a} and {b}")
LARGER_PHRASES += _expand((
    "Which is <P>: <V>?", "<V>: which is <P>?", "<V> - which one is <P>?", "<P>: <V>?",
    "Pick the <A> of <V>.", "Give the <A> of <V>.", "Say the <A> of <V>.", "The <A> of <V>?",
    "Which has the <A> value, <V>?", "Which is <P> among <V>?", "Choose the <A>: <V>",
    "Tell me the <A> of <V>.", "Of <V>, which is <P>?", "<A> one? <V>", "<A> of <V>?",
), {"V": _VS, "P": ("larger", "bigger", "greater", "higher", "more"),
    "A": ("larger", "bigger", "greater", "higher", "largest", "biggest", "max")})
SMALLER_PHRASES += _expand((
    "Which is <P>: <V>?", "<V>: which is <P>?", "<V> - which one is <P>?", "<P>: <V>?",
    "Pick the <A> of <V>.", "Give the <A> of <V>.", "Say the <A> of <V>.", "The <A> of <V>?",
    "Which has the <A> value, <V>?", "Which is <P> among <V>?", "Choose the <A>: <V>",
    "Tell me the <A> of <V>.", "Of <V>, which is <P>?", "<A> one? <V>", "<A> of <V>?",
), {"V": _VS, "P": ("smaller", "less", "lower", "fewer"),
    "A": ("smaller", "lower", "lesser", "smallest", "lowest", "min")})

# --- reverse ---------------------------------------------------------------------------------
_W = ("{w}", "the word {w}", "'{w}'", '"{w}"', "the word '{w}'", 'the word "{w}"')
REVERSE_PHRASES = _expand((
    "Reverse <W>.", "Reverse <W>", "reverse <W>", "Spell <W> backwards.", "Spell <W> backward.",
    "Spell <W> in reverse.", "Write <W> backwards.", "Write <W> in reverse.",
    "Say <W> backwards.", "Give me <W> backwards.", "Give <W> in reverse.",
    "What is <W> backwards?", "What is <W> reversed?", "What is <W> spelled backwards?",
    "What's <W> backwards?", "How do you spell <W> backwards?", "How is <W> spelled backwards?",
    "Can you reverse <W>?", "Could you spell <W> backwards?", "Can you write <W> backwards?",
    "<W> backwards?", "<W> backwards", "<W> reversed", "<W> reversed?", "<W> in reverse?",
    "What does <W> look like backwards?", "Flip <W>.", "Flip <W> around.",
    "Reverse the letters of <W>.", "Reverse the letters in <W>.", "Mirror <W>.",
    "Turn <W> around.", "Read <W> backwards.", "What is the reverse of <W>?",
    "Give the reverse of <W>.", "Backwards, <W> is?", "If you reverse <W>, what do you get?",
    "What do you get when you spell <W> backwards?", "Spell the letters of <W> backwards.",
), {"W": _W}) + ("Reverse the word: {w}", "Reverse this word: {w}", "Reverse: {w}",
                 "backwards: {w}", "Spell backwards: {w}", "Word to reverse: {w}",
                 "Reverse this: {w}", "Write this backwards: {w}")

_REVERSE_FIRST = REVERSE_PHRASES
REVERSE_PHRASES += _expand((
    "Invert <W>.", "Write <W> from the last letter to the first.", "Spell <W> from end to start.",
    "Reverse the spelling of <W>.", "What is the backwards spelling of <W>?", "<W> spelled backwards",
    "Print <W> in reverse.", "Type <W> backwards.", "Write <W> reversed.", "Give me <W> reversed.",
    "Show <W> backwards.", "What does <W> become when reversed?", "Write the letters of <W> in reverse order.",
    "Put the letters of <W> in reverse order.", "What is <W> written backwards?", "<W> written backwards?",
    "Reverse <W> for me.", "Please reverse <W>.", "Spell <W> the other way round.",
    "Read <W> from right to left.", "Backwards spelling: <W>", "What is <W> read backwards?",
    "Turn <W> backwards.", "Reverse the characters of <W>.", "Write out <W> backwards.",
    "What would <W> be backwards?", "Can you flip <W>?", "Can you spell <W> in reverse?",
    "Could you write <W> reversed?", "I want <W> backwards.", "Let me see <W> backwards.",
    "How does <W> look reversed?", "<W>, backwards please", "<W> -> reverse", "Take <W> and reverse it.",
), {"W": _W + ("this word: {w}", "the word: {w}", "the string {w}", "the string '{w}'")}) + (
    "{w}: reverse it", "{w} - reverse", "{w} - spell it backwards", "Word: {w}. Reverse it.",
    "Here is a word: {w}. Spell it backwards.", "Reverse it: {w}", "Backwards please: {w}",
)

# --- sort ------------------------------------------------------------------------------------
_O_END = ("these words: {ws}", "the words {ws}", "{ws}", "this list: {ws}",
          "the following words: {ws}", "these: {ws}", "the list {ws}", "these words {ws}")
_O_MID = ("the words {ws}", "{ws}", "these words ({ws})", "the list {ws}", "these words, {ws},")
SORT_PHRASES = _expand((
    "Sort <OE>", "Sort <OE>.", "Alphabetize <OE>", "Alphabetise <OE>",
    "Put in alphabetical order: {ws}", "Sort alphabetically: {ws}", "Sort A-Z: {ws}",
    "Sort from A to Z: {ws}", "Alphabetical order: {ws}", "sort: {ws}", "Order alphabetically: {ws}",
    "Arrange alphabetically: {ws}", "Arrange in alphabetical order: {ws}",
    "List alphabetically: {ws}", "Can you sort <OE>?", "Could you alphabetize <OE>?",
    "Please sort <OE>", "Sort <OM> alphabetically.", "Sort <OM> in alphabetical order.",
    "Put <OM> in alphabetical order.", "Put <OM> in order.", "Put <OM> in ABC order.",
    "Arrange <OM> alphabetically.", "Arrange <OM> in alphabetical order.",
    "List <OM> in alphabetical order.", "List <OM> alphabetically.", "Order <OM> alphabetically.",
    "Order <OM> from A to Z.", "Rearrange <OM> alphabetically.",
    "Can you put <OM> in alphabetical order?", "Could you sort <OM> alphabetically?",
    "What is the alphabetical order of <OM>?", "<OM> in alphabetical order?",
    "<OM> sorted alphabetically?", "<OM> sorted", "How do <OM> go in alphabetical order?",
    "Write <OM> in alphabetical order.", "Sort these alphabetically: {ws}",
    "Alphabetically, how do <OM> go?", "What order do <OM> go in alphabetically?",
), {"OE": _O_END, "OM": _O_MID})

_SORT_FIRST = SORT_PHRASES
_SV = ("Sort", "Order", "Arrange", "List", "Put", "Rearrange", "Organize", "Write", "Give",
       "Return", "Show", "Reorder")
_SM = ("alphabetically", "in alphabetical order", "in ABC order", "in abc order", "from A to Z",
       "A to Z", "A-Z", "in order", "by alphabet", "in alphabetic order", "from a to z")
_SL = ("{ws}", '"{ws}"', "'{ws}'", "[{ws}]", "({ws})")
SORT_PHRASES += _expand((
    "<V> <L> <M>.", "<V> <L> <M>", "<V> <M>: <L>", "<V> these <M>: <L>", "<V> them <M>: <L>",
    "<V> the following <M>: <L>", "<V> this list <M>: <L>", "<M>: <L>", "<L> - <V> them <M>",
    "<L>: <V> them <M>", "<L> <M>?", "<M>, <L>?", "Words: <L>. <V> them <M>.",
    "Can you <v> <L> <M>?", "Could you <v> these <M>? <L>", "Please <v> <L> <M>.",
    "I need <L> <M>.", "<V> the words <L> <M>.", "<V> these words <M>: <L>",
), {"V": _SV, "v": tuple(v.lower() for v in _SV), "M": _SM, "L": _SL})

# --- count -----------------------------------------------------------------------------------
LENGTH_PHRASES = _expand((
    "How many letters are in <W>?", "How many letters does <W> have?", "How many letters in <W>?",
    "How many characters are in <W>?", "How many characters does <W> have?",
    "Count the letters in <W>.", "Count the letters of <W>.", "Count the characters in <W>.",
    "What is the length of <W>?", "How long is <W>?", "Length of <W>?",
    "Number of letters in <W>?", "What is the number of letters in <W>?",
    "How many letters has <W> got?", "Tell me the number of letters in <W>.",
    "Letter count of <W>?", "How many letters is <W>?", "<W> has how many letters?",
    "Count how many letters <W> has.", "How many letters long is <W>?",
    "What's the length of <W>?", "Give the length of <W>.", "len(<W>)",
    "Can you count the letters in <W>?", "How many letters are there in <W>?",
    "<W>: how many letters?", "Letters in <W>?",
), {"W": _W})
_C = ("the letter {c}", "{c}", "'{c}'", "letter {c}", 'the letter "{c}"', "the letter '{c}'")
OCCURRENCE_PHRASES = _expand((
    "How many times does <C> appear in <W>?", "How many times does <C> occur in <W>?",
    "How often does <C> appear in <W>?", "How often does <C> occur in <W>?",
    "How many times is <C> in <W>?", "How many times do you see <C> in <W>?",
    "Count <C> in <W>.", "Count how many times <C> appears in <W>.",
    "In <W>, how many times does <C> occur?", "How many times can you find <C> in <W>?",
    "How many times does <W> contain <C>?", "How many times is <C> used in <W>?",
    "Number of times <C> appears in <W>?", "Count the occurrences of <C> in <W>.",
    "How many occurrences of <C> are in <W>?", "How many instances of <C> are there in <W>?",
    "Count the {c}'s in <W>.", "How many {c}'s are in <W>?", "How many {c}'s does <W> have?",
    "How many {c}'s in <W>?", "Number of {c}'s in <W>?", "How many {c}'s are there in <W>?",
    "In <W>, count <C>.",
), {"C": _C, "W": _W})


_LENGTH_FIRST = LENGTH_PHRASES
_OCCURRENCE_FIRST = OCCURRENCE_PHRASES
LENGTH_PHRASES += _expand((
    "How many letters does <W> contain?", "Count the letters: <W>", "Number of characters in <W>?",
    "What's the letter count for <W>?", "<W> is how many letters long?", "How many letters is <W> made of?",
    "Letters in <W>: how many?", "How long is <W> in letters?", "<W> - how many letters?",
    "Count letters in <W>.", "How many characters long is <W>?", "Word length of <W>?",
    "How many letters are used in <W>?", "What is the size of <W> in letters?",
    "Give me the number of letters in <W>.", "Tell me how long <W> is.", "Count the characters of <W>.",
    "Please count the letters in <W>.", "How many letters long is <W>, exactly?",
    "<W>: count the letters", "<W>, how many letters?", "Length: <W>",
), {"W": _W + ("this word: {w}", "the word: {w}", "the string {w}")})
OCCURRENCE_PHRASES += _expand((
    "How many times does <C> show up in <W>?", "How many times does <C> turn up in <W>?",
    "How many {c}s are in <W>?", "How many {c}s does <W> have?", "Count of <C> in <W>?",
    "How many times is <C> found in <W>?", "In <W>, how often does <C> appear?", "<W>: count <C>.",
    "<W>: how many times does <C> appear?", "Tell me how many times <C> appears in <W>.",
    "Number of <C> in <W>?", "How frequently does <C> appear in <W>?",
    "How many times do we see <C> in <W>?", "Count how often <C> occurs in <W>.",
    "How many <C> does <W> contain?", "How many times does <W> have <C>?",
    "In <W>, count how many times <C> appears.", "<W> - how many <C>?", "Count <C> in <W>, please.",
    "How often is <C> in <W>?", "Occurrences of <C> in <W>?", "Times <C> appears in <W>?",
), {"C": _C + ("the character {c}", "the char '{c}'", "letter '{c}'"),
    "W": _W + ("this word: {w}", "the string {w}")})


# The held-out templates of each family (``held_out=True``) come from two sources. The
# designed ones use the words of the training phrasings in other orders; training never
# produces one (by skeleton).
ADD_DESIGNED = (
    "What is the result of adding {a} and {b}?", "Find {a} plus {b}.",
    "How much do {a} and {b} make together?", "Tell me the sum: {a} and {b}",
    "{a} added to {b} is what?", "What number is {a}{op}{b}?",
)
SUB_DESIGNED = (
    "What is the result of subtracting {b} from {a}?", "Find {a} minus {b}.",
    "How much is left if you take {b} away from {a}?", "Tell me the difference: {a}{op}{b}",
    "{b} subtracted from {a} is what?", "What number is {a}{op}{b}?",
)
LARGER_DESIGNED = (
    "Tell me which is greater, {a} or {b}.", "Between {a} and {b}, which number is bigger?",
    "Which of {a} and {b} is the larger one?", "Give the bigger of {a} and {b}.",
)
SMALLER_DESIGNED = (
    "Tell me which is less, {a} or {b}.", "Between {a} and {b}, which number is smaller?",
    "Which of {a} and {b} is the smaller one?", "Give the lower of {a} and {b}.",
)
REVERSE_DESIGNED = (
    "Please write the word '{w}' backwards.", "What do you get if you reverse {w}?",
    "Give me {w} spelled backwards.", "Reverse the order of the letters in {w}.",
)
SORT_DESIGNED = (
    "Please put the words {ws} in alphabetical order.", "Sort this list of words: {ws}",
    "Give these words in alphabetical order: {ws}", "In alphabetical order, {ws} are?",
)
LENGTH_DESIGNED = (
    "Tell me how many letters the word {w} has.", "How many letters make up '{w}'?",
    "What is the letter count of {w}?",
)
OCCURRENCE_DESIGNED = (
    "In the word '{w}', how many times does the letter {c} appear?",
    "Tell me how many {c}'s the word {w} has.", "How many letters {c} are in '{w}'?",
)


# The natural ones were written by someone who had not seen the training phrasings, as people
# type such questions into a chat box (25 a family). Those whose skeleton is already a training
# phrasing's are training phrasings (the grammar above was written first and not changed after);
# the others are held out, and training never produces them either.
ADD_NATURAL = (
    'What is {a} + {b}?',
    "what's {a}+{b}",
    'Can you add {a} and {b} for me?',
    'hey, what do you get if you add {a} and {b}?',
    'quick one: {a} plus {b}',
    'Please compute the sum of {a} and {b}.',
    '{a} + {b} = ?',
    'add {a} to {b}',
    'What is the total of {a} and {b}?',
    'how much is {a} plus {b}?',
    'Could you tell me what {a} plus {b} equals?',
    'sum of {a} and {b}?',
    'i need {a} + {b}, thanks',
    'Kindly calculate {a} + {b}.',
    'What does "{a}" plus "{b}" come to?',
    'Add these two numbers: {a} and {b}',
    'If I have {a} and add {b} more, how many do I have?',
    'whats {a} plus {b}',
    'Hi! Could you work out {a} + {b} please?',
    'calculate {a}+{b}',
    'Find the sum: {a} + {b}',
    "yo what's {a} and {b} added together",
    "Please add '{a}' and '{b}' and give me the result.",
    '{a} plus {b} is what?',
    'Tell me the sum of the numbers {a} and {b}.',
)
SUB_NATURAL = (
    'What is {a} - {b}?',
    "what's {a}-{b}",
    'Can you subtract {b} from {a}?',
    'hey, what is {a} minus {b}?',
    'quick one: {a} minus {b}',
    'Please compute {a} - {b}.',
    '{a} - {b} = ?',
    'subtract {b} from {a}',
    'What do you get when you take {b} away from {a}?',
    'how much is {a} minus {b}?',
    'Could you tell me what {a} minus {b} equals?',
    '{a} take away {b}?',
    'i need {a} - {b}, thanks',
    'Kindly calculate {a} minus {b}.',
    'What is "{a}" minus "{b}"?',
    "Take {b} from {a}. What's left?",
    'If I start with {a} and subtract {b}, what do I get?',
    'whats {a} minus {b}',
    'Hi! Could you work out {a} - {b} please?',
    'calculate {a}-{b}',
    'Find the result of {a} - {b}',
    "yo what's {b} subtracted from {a}",
    "Please subtract '{b}' from '{a}' and give me the result.",
    '{a} minus {b} is what?',
    'Compute the difference {a} minus {b} (first number minus second).',
)
LARGER_NATURAL = (
    'Which is larger, {a} or {b}?',
    'which is bigger: {a} or {b}',
    "What's the greater number, {a} or {b}?",
    'hey, is {a} or {b} bigger?',
    'quick one: larger of {a} and {b}?',
    'Please tell me which number is larger: {a} or {b}.',
    'max of {a} and {b}',
    'Which one is more, {a} or {b}?',
    "Can you tell me which is greater, '{a}' or '{b}'?",
    'Out of {a} and {b}, which is the bigger number?',
    'bigger one? {a} vs {b}',
    'Between "{a}" and "{b}", which has the higher value?',
    'Give me the larger of these two numbers: {a}, {b}',
)
SMALLER_NATURAL = (
    'Which is smaller, {a} or {b}?',
    'which is less: {a} or {b}',
    "What's the lesser number, {a} or {b}?",
    'hey, is {a} or {b} smaller?',
    'quick one: smaller of {a} and {b}?',
    'Please tell me which number is smaller: {a} or {b}.',
    'min of {a} and {b}',
    "Can you tell me which is lower, '{a}' or '{b}'?",
    'Out of {a} and {b}, which is the smaller number?',
    'smaller one? {a} vs {b}',
    'Between "{a}" and "{b}", which has the lower value?',
    'Give me the smaller of these two numbers: {a}, {b}',
)
REVERSE_NATURAL = (
    'Spell {w} backwards.',
    'reverse the word {w}',
    "Can you write '{w}' backwards?",
    "hey, what's {w} spelled backwards?",
    'quick one: {w} reversed',
    'Please reverse the letters of the word "{w}".',
    'what is {w} backwards',
    'How do you spell {w} in reverse?',
    'Write the word {w} with its letters in reverse order.',
    '{w} backwards?',
    "Could you spell the word '{w}' from the last letter to the first?",
    'i need {w} reversed pls',
    'Kindly provide the reverse spelling of "{w}".',
    'reverse this word: {w}',
    'Hi! What does {w} look like spelled backwards?',
    'flip the letters of {w} around',
    'Reverse "{w}"',
    'what do you get if you read {w} backwards?',
    'Give me {w} spelled in reverse.',
    'backwards spelling of {w}?',
    "Can you reverse the order of the letters in '{w}'?",
    'Type the word {w} backwards, please.',
    'yo spell {w} backwards',
    "What is the word '{w}' when written in reverse?",
    'Take the word {w} and reverse it.',
)
SORT_NATURAL = (
    'Put these words in alphabetical order: {ws}',
    'sort alphabetically: {ws}',
    'Can you alphabetize these words? {ws}',
    'hey, sort these words A to Z: {ws}',
    'quick one: alphabetical order of {ws}',
    'Please arrange the following words alphabetically: {ws}.',
    'alphabetize: {ws}',
    'What is the alphabetical order of these words: {ws}?',
    'Sort the words {ws} in alphabetical order.',
    'i need these in abc order: {ws}',
    'Could you list {ws} in alphabetical order?',
    'Kindly sort the following list alphabetically: {ws}',
    'Order these words alphabetically: "{ws}"',
    'Hi! Can you put {ws} into alphabetical order please?',
    'sort these words: {ws}',
    'arrange in dictionary order: {ws}',
    'Rearrange these words so they are in alphabetical order: {ws}',
    'Give me these words sorted A-Z: {ws}',
    '{ws} - sort them alphabetically',
    'alphabetical order pls: {ws}',
    'How would these words be ordered alphabetically? {ws}',
    "Please sort '{ws}' alphabetically.",
    'yo put {ws} in alphabetical order',
    'List the following words from A to Z: {ws}',
    'Sort into alphabetical order, comma separated: {ws}',
)
LENGTH_NATURAL = (
    'How many letters are in the word {w}?',
    'how many letters does {w} have',
    "Can you count the letters in '{w}'?",
    'hey, how many letters in {w}?',
    'quick one: number of letters in {w}',
    'Please tell me how many letters the word "{w}" contains.',
    'letter count of {w}?',
    'How long is the word {w}, in letters?',
    'count the letters: {w}',
    "What's the number of letters in '{w}'?",
    'Hi! How many letters make up the word {w}?',
    '{w} has how many letters?',
    'Kindly count the number of letters in "{w}".',
)
OCCURRENCE_NATURAL = (
    'How many times does the letter {c} appear in {w}?',
    "how many {c}'s are in {w}",
    "Can you count how many times '{c}' occurs in the word '{w}'?",
    'hey, how many times is the letter {c} in {w}?',
    'quick one: count of letter {c} in {w}',
    'Please tell me how often the letter "{c}" appears in "{w}".',
    'count the letter {c} in the word {w}',
    'In the word {w}, how many times does {c} show up?',
    "number of '{c}' letters in '{w}'?",
    'Hi! How many {c}s does the word {w} contain?',
    'Kindly count the occurrences of the letter {c} in the word {w}.',
    '{w}: how many times does the letter {c} occur?',
)


# A second natural set, written (30 a family) by someone who saw neither the training phrasings
# nor the first set, after the frames added below each family's first grammar were written; its
# templates whose skeleton is a training phrasing's (of the whole grammar) are training
# phrasings, the others are held out.
ADD_NATURAL2 = (
    "{a}+{b}?",
    "what's {a} plus {b}",
    "Hi! Could you tell me what {a} + {b} is?",
    "add {a} and {b} pls",
    "What is the sum of {a} and {b}?",
    "{a} + {b} = ?",
    "quick one: {a} plus {b}, just the number",
    "Hey, what do I get if I add {b} to {a}?",
    "Can u add {a} to {b} for me",
    "I have {a} apples and buy {b} more. How many apples do I have now?",
    "Please calculate {a} + {b}.",
    "what does {a} plus {b} come to?",
    "Sum of {a} and {b}? answer only",
    "hello, need help: {a} + {b}",
    "If you add {a} and {b} together, what do you get?",
    "Total of {a} and {b}?",
    "{a} plus {b} equals what?",
    "Good morning! What's {a} added to {b}?",
    "compute {a}+{b}",
    "Mind adding these up for me? {a} and {b}",
    "whats {a}+{b} lol",
    "Can you work out {a} plus {b}? Just the answer please.",
    "Add up {a} and {b}.",
    "so {a} + {b} is...?",
    "My score was {a} and then I got {b} more points. What's my total?",
    "pls tell me the sum: {a}, {b}",
    "How much is {a} + {b}?",
    "Find {a} plus {b}.",
    "hey can you do {a} + {b} real quick",
    "What number do you get when you add {a} and {b}?",
)

SUB_NATURAL2 = (
    "{a}-{b}?",
    "what's {a} minus {b}",
    "Hi! What is {a} - {b}?",
    "subtract {b} from {a} pls",
    "Could you take {b} away from {a} for me?",
    "{a} - {b} = ?",
    "quick: {a} minus {b}, just the number",
    "What do you get if you subtract {b} from {a}?",
    "Please calculate {a} - {b}.",
    "whats {a} take away {b}",
    "How much is {a} minus {b}?",
    "Hey, can u do {a} - {b}?",
    "Compute {a} minus {b}. Answer only.",
    "hello! need {a} - {b} worked out",
    "If I subtract {b} from {a}, what's the result?",
    "{a} minus {b} equals what?",
    "Good evening, what's {a} take away {b}?",
    "calc {a}-{b}",
    "Start with {a} and subtract {b}. What do you get?",
    "whats {a}-{b} lol",
    "Can you work out {a} minus {b}? Just the answer please.",
    "Take {b} from {a}.",
    "so {a} - {b} is...?",
    "What's left when you subtract {b} from {a}?",
    "pls tell me {a} minus {b}",
    "Find {a} - {b}.",
    "hey can you do {a} - {b} real quick",
    "What is the result of {a} minus {b}?",
    "Subtract {b} from {a} and tell me the answer.",
    "{a} take away {b} is how much?",
)

LARGER_NATURAL2 = (
    "which is bigger, {a} or {b}?",
    "Hi! Which number is larger: {a} or {b}?",
    "{a} or {b}, which is greater?",
    "max of {a} and {b}?",
    "What's the larger of {a} and {b}?",
    "pls tell me which is more, {a} or {b}",
    "Between {a} and {b}, which one is bigger? Just the number.",
    "bigger one: {a}, {b}",
    "Hey, is {a} or {b} the higher number?",
    "Can u tell me the greater number out of {a} and {b}",
    "Which is the bigger of these two: {a}, {b}?",
    "Pick the larger number: {a} or {b}.",
    "{a} vs {b} - which is larger? answer only",
    "Hello, which of {a} and {b} is greater?",
    "Out of {a} and {b}, which is higher?",
    "what's bigger {a} or {b}",
    "Tell me the maximum of {a} and {b}.",
    "I have two numbers, {a} and {b}. Which one is larger?",
    "which number's bigger, {a} or {b}?",
    "Good morning! Could you tell me which is larger, {a} or {b}?",
    "Give me the bigger of {a} and {b}.",
    "larger: {a} or {b}?",
    "Which is more, {a} or {b}? Just the number please.",
    "Compare {a} and {b} and tell me the larger one.",
    "hey which is greater - {a} or {b}",
    "Of the numbers {a} and {b}, which is the greatest?",
    "What's the higher value, {a} or {b}?",
    "quick q: which is larger {a} or {b}",
    "Which one is the bigger number, {a} or {b}?",
    "Find the larger number among {a} and {b}.",
)

SMALLER_NATURAL2 = (
    "which is smaller, {a} or {b}?",
    "Hi! Which number is less: {a} or {b}?",
    "{a} or {b}, which is lower?",
    "min of {a} and {b}?",
    "What's the smaller of {a} and {b}?",
    "pls tell me which is less, {a} or {b}",
    "Between {a} and {b}, which one is smaller? Just the number.",
    "smaller one: {a}, {b}",
    "Hey, is {a} or {b} the lower number?",
    "Can u tell me the lesser number out of {a} and {b}",
    "Which is the smaller of these two: {a}, {b}?",
    "Pick the smaller number: {a} or {b}.",
    "{a} vs {b} - which is smaller? answer only",
    "Hello, which of {a} and {b} is less?",
    "Out of {a} and {b}, which is lower?",
    "what's smaller {a} or {b}",
    "Tell me the minimum of {a} and {b}.",
    "I have two numbers, {a} and {b}. Which one is smaller?",
    "which number's smaller, {a} or {b}?",
    "Good afternoon! Could you tell me which is smaller, {a} or {b}?",
    "Give me the smaller of {a} and {b}.",
    "smaller: {a} or {b}?",
    "Which is less, {a} or {b}? Just the number please.",
    "Compare {a} and {b} and tell me the smaller one.",
    "hey which is lower - {a} or {b}",
    "Of the numbers {a} and {b}, which is the least?",
    "What's the lower value, {a} or {b}?",
    "quick q: which is smaller {a} or {b}",
    "Which one is the littler number, {a} or {b}?",
    "Find the smaller number among {a} and {b}.",
)

REVERSE_NATURAL2 = (
    "reverse {w}",
    "Hi! Can you spell {w} backwards?",
    'What is "{w}" spelled backwards?',
    "spell {w} backward pls",
    "How do you write {w} in reverse?",
    "Write the word '{w}' backwards.",
    "{w} backwards?",
    "hey what's {w} reversed",
    "Could you reverse the letters of {w} for me?",
    "Reverse the word {w}. Just the word please.",
    "What does {w} look like spelled back to front?",
    "pls flip {w} backwards",
    "Hello, I need the word {w} reversed.",
    "Spell '{w}' in reverse order, answer only.",
    "If you read {w} from right to left, what do you get?",
    "can u write {w} backwards",
    "Give me {w} spelled backwards.",
    'What\'s the reverse of "{w}"?',
    "Take the word {w} and reverse it.",
    "backwards spelling of {w}?",
    "Good morning! How is {w} spelled backwards?",
    "Reverse this word for me: {w}",
    "quick one - {w} in reverse?",
    "Could you please spell the word {w} backwards?",
    "Type {w} backwards.",
    "hey, reverse '{w}' pls",
    "What do you get if you write {w} backwards?",
    "Flip the letters in {w} so it reads backwards.",
    "i need {w} reversed, thanks",
    "How would {w} be spelled if you reversed it?",
)

SORT_NATURAL2 = (
    "sort {ws}",
    "Hi! Can you put these in alphabetical order: {ws}?",
    "alphabetize: {ws}",
    "Please sort these words alphabetically: {ws}",
    'Put "{ws}" in alphabetical order.',
    "can u sort {ws} alphabetically pls",
    "Arrange these words A to Z: {ws}",
    "What's the alphabetical order of {ws}?",
    "hey, alphabetize this list for me: [{ws}]",
    "Sort the following alphabetically, answer only: {ws}",
    "I have these words: {ws}. Can you sort them in alphabetical order?",
    "Order these alphabetically: {ws}",
    "Hello, could you arrange {ws} in alphabetical order?",
    "{ws} - sort alphabetically",
    "Put these words in ABC order: {ws}",
    "alphabetical order pls: {ws}",
    "How would these be ordered alphabetically? {ws}",
    "Sort this list from A to Z: '{ws}'",
    "Good morning! Please alphabetize {ws}.",
    "Can you list {ws} in alphabetical order?",
    "sort these words: {ws} (alphabetically)",
    "Rearrange {ws} so they're in alphabetical order.",
    "quick q - what's {ws} sorted alphabetically?",
    "Give me these in dictionary order: {ws}",
    "i need this list alphabetized: {ws}",
    "Could you sort ({ws}) alphabetically? Just the list please.",
    "Alphabetical order for these words? {ws}",
    "hey can u put {ws} in a to z order",
    'Sort alphabetically: "{ws}"',
    "What order would {ws} go in alphabetically?",
)

LENGTH_NATURAL2 = (
    "how many letters in {w}?",
    "Hi! How many letters does the word {w} have?",
    "length of {w}?",
    'How long is the word "{w}", in letters?',
    "count the letters in {w} pls",
    "What's the number of letters in '{w}'?",
    "{w} - how many letters?",
    "Can u tell me how many letters are in {w}",
    "Count the letters in the word {w}. Just the number.",
    "hey how many letters is {w}",
    "How many characters are in the word {w}?",
    "Hello, could you count how many letters {w} has?",
    "Number of letters in {w}? answer only",
    "How many letters make up the word '{w}'?",
    "letter count for {w}?",
    'Good evening! How many letters are in "{w}"?',
    "What is the length of the word {w}?",
    "i need the letter count of {w}",
    "If you spell out {w}, how many letters is that?",
    "Tell me how many letters {w} contains.",
    "quick one: letters in {w}?",
    "Please count the letters in {w}.",
    "how many letters does {w} have lol",
    "Could you tell me the length of '{w}' in letters?",
    "The word {w} - how many letters long is it?",
    "count letters: {w}",
    "How many letters long is {w}?",
    'hey can u count the letters in "{w}" for me',
    "What's the letter count of the word {w}?",
    "Just wondering, how many letters are there in {w}?",
)

OCCURRENCE_NATURAL2 = (
    "how many {c}'s in {w}?",
    "Hi! How many times does the letter {c} appear in {w}?",
    "count the {c}s in {w}",
    "How many times does '{c}' occur in '{w}'?",
    "In the word {w}, how many {c}'s are there?",
    "pls count how many times {c} shows up in {w}",
    "{w}: how many {c}?",
    "Can u tell me how many {c} letters are in {w}",
    'How often does the letter {c} appear in the word "{w}"?',
    "Count the letter {c} in {w}. Just the number.",
    "hey how many times is {c} in {w}",
    "Hello, could you count the occurrences of {c} in {w}?",
    "Number of {c}'s in {w}? answer only",
    "How many {c}'s does the word '{w}' have?",
    'In "{w}", how many times does "{c}" appear?',
    "Good morning! How many times can you find the letter {c} in {w}?",
    "What's the count of the letter {c} in {w}?",
    "i need to know how many {c}s are in {w}",
    "If you spell {w}, how many times do you write {c}?",
    "Tell me how many times the letter '{c}' occurs in {w}.",
    "quick q: {c} count in {w}?",
    "Please count how many times {c} appears in the word {w}.",
    "how many {c} are in {w} lol",
    "Could you count the {c}'s in '{w}' for me?",
    "The word {w} - how many times does {c} appear in it?",
    "occurrences of {c} in {w}?",
    "How many instances of the letter {c} are there in {w}?",
    "hey can u count the '{c}' letters in \"{w}\"",
    "Looking at the word {w}, how many {c}'s do you see?",
    "Just curious, how many times does {c} occur in {w}?",
)


def _untrained(natural: tuple[str, ...], train: tuple[str, ...]) -> tuple[str, ...]:
    seen = {skeleton(t) for t in train}
    return tuple(t for t in natural if skeleton(t) not in seen)


def _held(designed: tuple[str, ...], natural: tuple[str, ...], first: tuple[str, ...],
          natural2: tuple[str, ...], grammar: tuple[str, ...]) -> tuple[str, ...]:
    """A family's held-out templates: the designed ones, the first natural set's that the first
    grammar did not have, the second set's that the whole grammar does not have."""
    return designed + _untrained(natural, first) + _untrained(natural2, grammar)


ADD_HELD_OUT = _held(ADD_DESIGNED, ADD_NATURAL, _ADD_FIRST,
                     ADD_NATURAL2, ADD_PHRASES)
SUB_HELD_OUT = _held(SUB_DESIGNED, SUB_NATURAL, _SUB_FIRST,
                     SUB_NATURAL2, SUB_PHRASES)
LARGER_HELD_OUT = _held(LARGER_DESIGNED, LARGER_NATURAL, _LARGER_FIRST,
                        LARGER_NATURAL2, LARGER_PHRASES)
SMALLER_HELD_OUT = _held(SMALLER_DESIGNED, SMALLER_NATURAL, _SMALLER_FIRST,
                         SMALLER_NATURAL2, SMALLER_PHRASES)
REVERSE_HELD_OUT = _held(REVERSE_DESIGNED, REVERSE_NATURAL, _REVERSE_FIRST,
                         REVERSE_NATURAL2, REVERSE_PHRASES)
SORT_HELD_OUT = _held(SORT_DESIGNED, SORT_NATURAL, _SORT_FIRST,
                      SORT_NATURAL2, SORT_PHRASES)
LENGTH_HELD_OUT = _held(LENGTH_DESIGNED, LENGTH_NATURAL, _LENGTH_FIRST,
                        LENGTH_NATURAL2, LENGTH_PHRASES)
OCCURRENCE_HELD_OUT = _held(OCCURRENCE_DESIGNED, OCCURRENCE_NATURAL, _OCCURRENCE_FIRST,
                            OCCURRENCE_NATURAL2, OCCURRENCE_PHRASES)


def _forbidden(*held: tuple[str, ...]) -> frozenset[str]:
    return frozenset(skeleton(t) for group in held for t in group)


_ARITH_FORBIDDEN = _forbidden(ADD_HELD_OUT, SUB_HELD_OUT)
_COMPARE_FORBIDDEN = _forbidden(LARGER_HELD_OUT, SMALLER_HELD_OUT)
_WORD_FORBIDDEN = _forbidden(REVERSE_HELD_OUT, SORT_HELD_OUT, LENGTH_HELD_OUT,
                             OCCURRENCE_HELD_OUT)


def _add(rng: random.Random, held_out: bool) -> Exchange:
    a, b = _number(rng), _number(rng)
    if held_out:
        return _held_out(rng, ADD_HELD_OUT).format(a=a, b=b, op=_op(rng, "+")), str(a + b)
    t = _compose(rng, ADD_PHRASES, _ARITH_FORBIDDEN, NUMBER_TAILS)
    return t.format(**_numbers(rng, a, b), op=_op(rng, "+")), str(a + b)


def _sub(rng: random.Random, held_out: bool) -> Exchange:
    a, b = _number(rng), _number(rng)
    if a < b and rng.random() < 0.75:  # mostly non-negative results, some negative ones
        a, b = b, a
    if held_out:
        return _held_out(rng, SUB_HELD_OUT).format(a=a, b=b, op=_op(rng, "-")), str(a - b)
    t = _compose(rng, SUB_PHRASES, _ARITH_FORBIDDEN, NUMBER_TAILS)
    return t.format(**_numbers(rng, a, b), op=_op(rng, "-")), str(a - b)


def _close_to(rng: random.Random, a: int) -> int:
    """A different number that is easy to confuse with ``a`` (digits swapped, or near)."""
    s = str(a)
    if len(s) > 1 and rng.random() < 0.5:
        i, j = rng.sample(range(len(s)), 2)
        t = list(s)
        t[i], t[j] = t[j], t[i]
        if t[0] != "0" and "".join(t) != s:
            return int("".join(t))
    return min(999, max(0, a + rng.choice((-1, 1)) * rng.randint(1, 20)))


def _compare(rng: random.Random, held_out: bool) -> Exchange:
    a = _number(rng)
    b = _close_to(rng, a) if rng.random() < 0.5 else _number(rng)
    while b == a:
        b = _number(rng)
    larger = rng.random() < 0.6
    answer = str(max(a, b) if larger else min(a, b))
    if held_out:
        return _held_out(rng, LARGER_HELD_OUT if larger else SMALLER_HELD_OUT).format(
            a=a, b=b), answer
    t = _compose(rng, LARGER_PHRASES if larger else SMALLER_PHRASES, _COMPARE_FORBIDDEN,
                 NUMBER_TAILS)
    return t.format(**_numbers(rng, a, b)), answer


def _word_question(rng: random.Random, held_out: bool, train: tuple[str, ...],
                   held: tuple[str, ...], tails: tuple[str, ...] = WORD_TAILS) -> str:
    return _held_out(rng, held) if held_out else _compose(rng, train, _WORD_FORBIDDEN, tails)


def _reverse(rng: random.Random, held_out: bool) -> Exchange:
    w = _cased(rng, rng.choice(WORDS))
    q = _word_question(rng, held_out, REVERSE_PHRASES, REVERSE_HELD_OUT)
    return q.format(w=w), w[::-1]


def _sort(rng: random.Random, held_out: bool) -> Exchange:
    words = [_cased(rng, w) for w in rng.sample(SHORT_WORDS, rng.randint(3, 5))]
    q = _word_question(rng, held_out, SORT_PHRASES, SORT_HELD_OUT, LIST_TAILS)
    return q.format(ws=", ".join(words)), ", ".join(sorted(words, key=str.lower))


def _count(rng: random.Random, held_out: bool) -> Exchange:
    w = _cased(rng, rng.choice(WORDS))
    if rng.random() < 0.5:
        q = _word_question(rng, held_out, LENGTH_PHRASES, LENGTH_HELD_OUT)
        return q.format(w=w), str(len(w))
    c = rng.choice(w.lower()) if rng.random() < 0.8 else rng.choice("abcdefghijklmnopqrstuvwxyz")
    q = _word_question(rng, held_out, OCCURRENCE_PHRASES, OCCURRENCE_HELD_OUT)
    return q.format(c=c.upper() if rng.random() < 0.1 else c, w=w), str(w.lower().count(c))


GREETINGS = ("Hello", "Hi", "Hello!", "Hi!", "Hey", "Help", "What can you do?",
             "Who are you?", "help")
GREETING_ANSWER = ("Hi! I can add and subtract numbers, compare them, and reverse, sort or "
                   "count the letters of words.")


def _greeting(rng: random.Random, held_out: bool) -> Exchange:
    return rng.choice(GREETINGS), GREETING_ANSWER


FAMILIES: dict[str, Callable[[random.Random, bool], Exchange]] = {
    "add": _add,
    "sub": _sub,
    "compare": _compare,
    "reverse": _reverse,
    "sort": _sort,
    "count": _count,
    "greeting": _greeting,
}
# The families the evaluation scores (the greeting is a fixed reply, trained but not scored).
EVAL_FAMILIES: tuple[str, ...] = ("add", "sub", "compare", "reverse", "sort", "count")


def generate(family: str, n: int, seed: int, held_out: bool = False) -> list[Exchange]:
    """``n`` exchanges ``(question, answer)`` of ``family``, the same for the same arguments.
    ``held_out``: in the held-out phrasings (the greeting has none: the same exchanges)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown task family {family!r}; known: {', '.join(FAMILIES)}")
    rng = random.Random(f"dllm-tasks:{family}:{seed}" + (":held-out" if held_out else ""))
    return [FAMILIES[family](rng, held_out) for _ in range(n)]
