"""`[distill]`: on-policy distillation, a teacher's log-probs of the student's sampled tokens as
the training signal (one teacher, or one per task). docs/distillation.md."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from cadence.config.base import Section


class TeacherConfig(Section):
    path: str
    """A local Hugging Face causal-LM directory with the student's tokenizer."""
    tasks: list[str] = Field(default_factory=list, min_length=1)
    """The prompts it scores, by their task label: a reasoning-gym dataset's name in a mix."""


class DistillConfig(Section):
    teacher: str = ""
    """A local Hugging Face causal-LM directory that scores every prompt; '': no distillation
    (unless `teachers` names one per task). Its tokenizer must be the student's: a teacher whose
    vocabulary or special tokens differ is refused before any weight loads."""
    teachers: list[TeacherConfig] = Field(default_factory=list)
    """One teacher per task ([[distill.teachers]] with `path` and `tasks`): each prompt is scored
    by the teacher of its task; a task no teacher names is refused when the run starts."""
    coef: float = Field(1.0, ge=0.0)
    """Weight of the distillation advantage: per sampled token, coef x (log pi_teacher - log
    pi_student)."""
    reward_coef: float = Field(0.0, ge=0.0)
    """Weight of the reward's advantage added to it: 0 pure distillation, 1 RL plus
    distillation."""
    placement: Literal["learner", "worker"] = "learner"
    """Where a teacher runs: learner (a frozen copy beside the reference, a no-grad pass over the
    learner's micro-batch layout, in the learner's process or each learner rank), or worker (a
    teacher stage: processes of their own that score rows as they reach the sample store, so
    the learner holds no teacher; needs pipeline.placement = 'separate')."""
    num_workers: int = Field(1, ge=1)
    """placement 'worker': teacher worker processes (each holds every teacher)."""
    threads_per_worker: int = Field(1, ge=1)
    """placement 'worker': torch threads in each teacher worker."""
    batch_size: int = Field(16, ge=1)
    """placement 'worker': most responses a teacher worker takes at once."""

    @model_validator(mode="after")
    def _one_way(self) -> DistillConfig:
        if self.teacher and self.teachers:
            raise ValueError("set distill.teacher (one teacher) or [[distill.teachers]], not both")
        tasks = [t for teacher in self.teachers for t in teacher.tasks]
        twice = sorted({t for t in tasks if tasks.count(t) > 1})
        if twice:
            raise ValueError(f"task(s) {twice} have more than one teacher in [[distill.teachers]]")
        return self

    @property
    def on(self) -> bool:
        return bool(self.teacher or self.teachers)

    @property
    def by_task(self) -> dict[str, str]:
        """Task label -> teacher directory ("" for the one teacher of every prompt)."""
        if self.teacher:
            return {"": self.teacher}
        return {task: t.path for t in self.teachers for task in t.tasks}

    @property
    def paths(self) -> list[str]:
        """The teachers' directories, each once."""
        return list(dict.fromkeys(self.by_task.values()))
