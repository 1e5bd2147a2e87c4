"""Guess a secret number; the tool says higher or lower. Stage reward 1 for the right guess."""
import random
import threading

from rollout.envs.base import Judgement, StepResult, Task


class GuessEnv:
    def __init__(self, rng: random.Random, max_turns: int):
        self.rng, self.max_turns = rng, max_turns

    def reset(self, task: Task) -> str:
        self.high = task.data["high"]
        self.secret = self.rng.randint(0, self.high)
        self.turns, self.found = 0, False
        return f"guess 0 to {self.high}"

    def step(self, action: str) -> StepResult:
        self.turns += 1
        guess = action.strip()
        if not guess.isdigit():
            answer = "number"  # a malformed action gets an observation that says so, not an exception
        elif int(guess) == self.secret:
            self.found = True
            return StepResult(observation=None, reward=1.0, done=True)
        else:
            answer = "higher" if int(guess) < self.secret else "lower"
        return StepResult(observation=answer, reward=0.0, done=self.turns >= self.max_turns)

    def judge(self) -> Judgement:
        return Judgement(score=float(self.found), success=self.found, info={"turns": float(self.turns)})


class GuessFactory:
    max_action_tokens = 1  # one word per turn

    def __init__(self, max_turns: int, seed: int):
        self.max_turns = max_turns
        self.seeds = random.Random(seed)
        self.lock = threading.Lock()  # make() is called from the worker; keep shared state safe anyway

    def tasks(self, split: str) -> list[Task]:
        highs = [3, 5, 7] if split == "train" else [9]
        return [Task(id=f"high{h}", data={"high": h}) for h in highs]

    def make(self) -> GuessEnv:
        with self.lock:
            return GuessEnv(random.Random(self.seeds.getrandbits(64)), self.max_turns)

    def vocabulary(self) -> list[str]:
        return ["guess", "to", "higher", "lower", "number"] + [str(n) for n in range(10)]


def factory(max_turns: int = 4, seed: int = 0) -> GuessFactory:
    return GuessFactory(int(max_turns), int(seed))
