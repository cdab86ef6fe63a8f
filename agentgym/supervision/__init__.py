"""Process and thread supervision, one floor above ``agentgym.core``: stage deadlines with
stack dumps (``watchdog``), servers restarted on failure (``supervisor``), child servers that
end with their parent (``server_process``), hung calls cut by site (``stalls``), pools of
daemon workers that replace a stuck one (``daemon_pool``), and calls in a child process
(``process_call``). It imports ``agentgym.core`` only.
"""
