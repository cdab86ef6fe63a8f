import verifiers.v1 as vf

from vf_calc.tool import CalcToolset


class CalcData(vf.TaskData):
    answer: str = ""


class CalcTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class CalcTask(vf.Task[CalcData, vf.State, CalcTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalcTaskConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]

    @vf.reward(weight=0.75)
    async def correct(self, trace: vf.Trace) -> float:
        """The sum is in the last reply."""
        return float(self.data.answer in str(trace.last_message.content or "").split())

    @vf.reward(weight=0.25)
    async def brief(self, trace: vf.Trace) -> float:
        """The last reply is short."""
        return float(len(str(trace.last_message.content or "")) <= 12)


class CalcConfig(vf.TasksetConfig):
    num_tasks: int = 10
    task: CalcTaskConfig = CalcTaskConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self) -> list[CalcTask]:
        return [CalcTask(CalcData(prompt=f"What is {i} + {2 * i + 3}? Use the add tool.",
                                  answer=str(3 * i + 3)), self.config.task)
                for i in range(self.config.num_tasks)]
