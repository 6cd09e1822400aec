"""pagoda.lang: an SGLang-style embedded language for generation programs.

    from pagoda import lang

    @lang.function
    def structured_generation(s):
        s += "请以JSON格式输出:\\n"
        s += {"name": lang.gen("姓名", max_len=8)}
        s += {"age": lang.gen("年龄", regex="[0-9]+")}
        return s

    state = structured_generation.run(backend=lang.Engine("smollm2"))
    state.text()     # '请以JSON格式输出:\\n{"name": "...", "age": 42}'
    state["年龄"]     # '42'

Programs run on the in-process engine (`Engine`) or a pagoda server (`Endpoint(url)`).
"""

from pagoda.lang.endpoint import Endpoint, Engine, Generated
from pagoda.lang.ir import Gen, assistant, gen, select, system, user
from pagoda.lang.program import Program, function, set_default_backend
from pagoda.lang.state import Forks, ProgramState

__all__ = [
    "Endpoint", "Engine", "Forks", "Gen", "Generated", "Program", "ProgramState", "assistant", "function", "gen",
    "select", "set_default_backend", "system", "user",
]
