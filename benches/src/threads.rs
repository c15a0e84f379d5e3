//! Per-thread and per-process CPU time and context switches, from `/proc`.

use crate::alloc::ALLOCATOR;

/// Each thread's context switches and CPU time so far (Linux: `/proc/self/task`), by thread
/// id: where a message's hand-offs and work happen, which the process's totals do not say.
pub(crate) struct ThreadUsage(std::collections::BTreeMap<u32, ThreadCounts>);

/// One thread's counts.
pub(crate) struct ThreadCounts {
    pub(crate) name: String,
    pub(crate) context_switches: u64,
    /// Of `context_switches`, those where the thread was taken off its CPU while it could
    /// still run (preempted), not parked to wait.
    pub(crate) preempted: u64,
    pub(crate) on_cpu_ns: u64,
    /// Nanoseconds runnable but waiting for a CPU.
    pub(crate) waiting_for_cpu_ns: u64,
}

impl ThreadUsage {
    pub(crate) fn now() -> Self {
        let read = |tid: &std::path::Path| -> Option<ThreadCounts> {
            let name = std::fs::read_to_string(tid.join("comm")).ok()?;
            let status = std::fs::read_to_string(tid.join("status")).ok()?;
            let count = |key: &str| -> u64 {
                status
                    .lines()
                    .filter(|l| l.starts_with(key))
                    .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                    .sum()
            };
            // Nanoseconds on a CPU, then nanoseconds runnable and waiting for one.
            let schedstat = std::fs::read_to_string(tid.join("schedstat")).unwrap_or_default();
            let mut fields = schedstat.split_whitespace().map(|f| f.parse().unwrap_or(0));
            let preempted = count("nonvoluntary_ctxt_switches:");
            Some(ThreadCounts {
                name: name.trim().to_owned(),
                context_switches: count("voluntary_ctxt_switches:") + preempted,
                preempted,
                on_cpu_ns: fields.next().unwrap_or(0),
                waiting_for_cpu_ns: fields.next().unwrap_or(0),
            })
        };
        let threads = std::fs::read_dir("/proc/self/task")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| {
                let tid = entry.file_name().to_str()?.parse().ok()?;
                Some((tid, read(&entry.path())?))
            })
            .collect();
        Self(threads)
    }

    /// Threads on a CPU more than a tenth of the `seconds` since `before`, busiest first, as
    /// "name#tid 0.98 (20/s), name#tid 0.40 (3000/s; 0.05 waiting for a CPU, 900/s
    /// preempted)": the fraction of those seconds on a CPU, and how often per second the
    /// thread was switched out (mostly to wait: an endpoint thread with nothing to do parks,
    /// and each wake-up costs a switch back). Where the thread was kept from a CPU while it
    /// could run for more than a hundredth of the time, or preempted more than 10 times a
    /// second, it says so: then another thread took its core, not a lack of work.
    pub(crate) fn busy_since(&self, before: &Self, seconds: f64) -> String {
        let seconds = seconds.max(1e-9);
        let mut busy: Vec<(f64, String)> = self
            .0
            .iter()
            .filter_map(|(tid, now)| {
                let then = before.0.get(tid);
                let since = |count: fn(&ThreadCounts) -> u64| {
                    count(now).saturating_sub(then.map_or(0, count)) as f64 / seconds
                };
                let share = since(|c| c.on_cpu_ns) / 1e9;
                let per_second = since(|c| c.context_switches);
                let waiting = since(|c| c.waiting_for_cpu_ns) / 1e9;
                let preempted = since(|c| c.preempted);
                let kept_off = if waiting > 0.01 || preempted > 10.0 {
                    format!("; {waiting:.2} waiting for a CPU, {preempted:.0}/s preempted")
                } else {
                    String::new()
                };
                (share > 0.1).then(|| {
                    (
                        share,
                        format!(
                            "{}#{tid} {share:.2} ({per_second:.0}/s{kept_off})",
                            now.name
                        ),
                    )
                })
            })
            .collect();
        busy.sort_by(|a, b| b.0.total_cmp(&a.0));
        busy.into_iter()
            .map(|(_, thread)| thread)
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Per message since `before`, threads that switched at least once per 100 messages,
    /// as "name 1.00 (31 µs), name 0.02 (0 µs)": context switches and CPU time.
    pub(crate) fn since(&self, before: &Self, messages: u64) -> String {
        let per = |n: u64| n as f64 / messages.max(1) as f64;
        self.0
            .iter()
            .filter_map(|(tid, now)| {
                let (switches, ns) = before
                    .0
                    .get(tid)
                    .map_or((0, 0), |then| (then.context_switches, then.on_cpu_ns));
                let switched = per(now.context_switches.saturating_sub(switches));
                let cpu_us = per(now.on_cpu_ns.saturating_sub(ns)) / 1e3;
                (switched >= 0.01).then(|| format!("{} {switched:.2} ({cpu_us:.0} µs)", now.name))
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// This process's CPU time and context switches so far, every thread's (ended ones too),
/// and the allocations counted so far.
#[derive(Clone, Copy)]
pub(crate) struct ProcessUsage {
    pub(crate) cpu_seconds: f64,
    pub(crate) context_switches: i64,
    pub(crate) allocations: u64,
}

impl ProcessUsage {
    pub(crate) fn now() -> Option<Self> {
        use nix::sys::resource::{UsageWho, getrusage};
        let usage = getrusage(UsageWho::RUSAGE_SELF).ok()?;
        let seconds = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
        Some(Self {
            cpu_seconds: seconds(usage.user_time()) + seconds(usage.system_time()),
            context_switches: usage.voluntary_context_switches()
                + usage.involuntary_context_switches(),
            allocations: ALLOCATOR.allocations(),
        })
    }

    pub(crate) fn since(&self, before: &Self) -> Self {
        Self {
            cpu_seconds: self.cpu_seconds - before.cpu_seconds,
            context_switches: self.context_switches - before.context_switches,
            allocations: self.allocations - before.allocations,
        }
    }
}
