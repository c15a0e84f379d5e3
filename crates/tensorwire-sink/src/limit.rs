//! How much memory this process may really use: the tightest of its control groups' limits
//! and physical memory, so that budgets sized from it hold inside a container.

use std::path::{Path, PathBuf};

/// Memory this process may use, and where the figure comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryLimit {
    /// Bytes.
    pub bytes: u64,
    /// Where the figure comes from.
    pub source: LimitSource,
}

/// Where a [`MemoryLimit`] comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LimitSource {
    /// A control group's limit file (cgroup v2 `memory.max` or `memory.high`, v1
    /// `memory.limit_in_bytes`), on this process's group or one above it.
    ControlGroup(PathBuf),
    /// Physical memory (`MemTotal`), no control group limiting less.
    Physical,
    /// Nothing could be read: an assumed 16 GiB.
    Assumed,
}

/// What [`MemoryLimit::Assumed`] assumes.
const ASSUMED: u64 = 16 << 30;

/// cgroup v1 writes "no limit" as a huge number (2^63 rounded down to a page).
const UNLIMITED_V1: u64 = 1 << 62;

impl MemoryLimit {
    /// This process's limit, read from `/proc` and `/sys/fs/cgroup`.
    pub fn of_this_process() -> Self {
        Self::read_under(Path::new("/"))
    }

    /// The limit as the files under `root` tell it (`/` for this process; another root
    /// for a container's filesystem seen from outside): `proc/self/cgroup`,
    /// `proc/meminfo` and the control groups mounted at `sys/fs/cgroup`.
    pub fn read_under(root: &Path) -> Self {
        let physical = std::fs::read_to_string(root.join("proc/meminfo"))
            .ok()
            .and_then(|info| mem_total(&info));
        let groups = std::fs::read_to_string(root.join("proc/self/cgroup")).unwrap_or_default();
        let tightest = limit_files(root, &groups)
            .into_iter()
            .filter_map(|file| Some((limit_in(&file)?, file)))
            .min_by_key(|(bytes, _)| *bytes);
        match (tightest, physical) {
            (Some((bytes, file)), Some(physical)) if bytes < physical => Self {
                bytes,
                source: LimitSource::ControlGroup(file),
            },
            (_, Some(physical)) => Self {
                bytes: physical,
                source: LimitSource::Physical,
            },
            (Some((bytes, file)), None) => Self {
                bytes,
                source: LimitSource::ControlGroup(file),
            },
            (None, None) => Self {
                bytes: ASSUMED,
                source: LimitSource::Assumed,
            },
        }
    }
}

impl std::fmt::Display for LimitSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LimitSource::ControlGroup(file) => {
                write!(f, "the control group limit in {}", file.display())
            }
            LimitSource::Physical => f.write_str("physical memory"),
            LimitSource::Assumed => f.write_str("assumed: no memory size could be read"),
        }
    }
}

/// `MemTotal` of `/proc/meminfo`, in bytes.
fn mem_total(info: &str) -> Option<u64> {
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Every limit file that may bound this process: for each group `/proc/self/cgroup` names
/// (v2 `0::PATH`, v1 `N:…memory…:PATH`), that group's and each ancestor's, at each place
/// the hierarchy may be mounted. Files that do not exist are left out.
fn limit_files(root: &Path, groups: &str) -> Vec<PathBuf> {
    let mounts = root.join("sys/fs/cgroup");
    let mut files = Vec::new();
    for line in groups.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let (bases, names): (Vec<PathBuf>, &[&str]) = if id == "0" && controllers.is_empty() {
            (
                vec![mounts.clone(), mounts.join("unified")],
                &["memory.max", "memory.high"],
            )
        } else if controllers.split(',').any(|c| c == "memory") {
            (vec![mounts.join("memory")], &["memory.limit_in_bytes"])
        } else {
            continue;
        };
        let relative = Path::new(path.trim_start_matches('/'));
        for base in bases {
            // The group and every ancestor, up to the mount's root; bounded by the path.
            for ancestor in relative.ancestors() {
                for name in names {
                    let file = base.join(ancestor).join(name);
                    if file.is_file() {
                        files.push(file);
                    }
                }
            }
        }
    }
    files
}

/// The limit a file sets, in bytes; `None` for no limit (`max`, v1's huge value) or a file
/// that cannot be read.
fn limit_in(file: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    let bytes: u64 = text.trim().parse().ok()?;
    (bytes < UNLIMITED_V1).then_some(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake root with `files` (path, content), removed when dropped.
    struct Tree(PathBuf);

    impl Tree {
        fn new(name: &str, files: &[(&str, &str)]) -> Self {
            let root = std::env::temp_dir()
                .join(format!("tensorwire-limit-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            for (path, content) in files {
                let path = root.join(path);
                std::fs::create_dir_all(path.parent().unwrap()).unwrap();
                std::fs::write(path, content).unwrap();
            }
            Self(root)
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    const MEMINFO: &str = "MemTotal:       16384000 kB\nMemFree: 1 kB\n";

    #[test]
    fn a_v2_group_limit_below_physical_memory_wins() {
        let tree = Tree::new(
            "v2",
            &[
                ("proc/meminfo", MEMINFO),
                ("proc/self/cgroup", "0::/pods/rx\n"),
                ("sys/fs/cgroup/pods/rx/memory.max", "max\n"),
                ("sys/fs/cgroup/pods/rx/memory.high", "2147483648\n"),
                ("sys/fs/cgroup/pods/memory.max", "1073741824\n"),
            ],
        );
        let limit = MemoryLimit::read_under(&tree.0);
        assert_eq!(limit.bytes, 1 << 30, "the parent's memory.max is tighter");
        assert_eq!(
            limit.source,
            LimitSource::ControlGroup(tree.0.join("sys/fs/cgroup/pods/memory.max"))
        );
    }

    #[test]
    fn a_v1_memory_group_counts_and_its_unlimited_value_does_not() {
        let tree = Tree::new(
            "v1",
            &[
                ("proc/meminfo", MEMINFO),
                ("proc/self/cgroup", "4:memory:/job\n3:cpu:/job\n0::/\n"),
                (
                    "sys/fs/cgroup/memory/job/memory.limit_in_bytes",
                    "536870912\n",
                ),
                (
                    "sys/fs/cgroup/memory/memory.limit_in_bytes",
                    "9223372036854771712\n",
                ),
            ],
        );
        assert_eq!(MemoryLimit::read_under(&tree.0).bytes, 512 << 20);
        let unlimited = Tree::new(
            "v1-unlimited",
            &[
                ("proc/meminfo", MEMINFO),
                ("proc/self/cgroup", "4:memory:/\n"),
                (
                    "sys/fs/cgroup/memory/memory.limit_in_bytes",
                    "9223372036854771712\n",
                ),
            ],
        );
        let limit = MemoryLimit::read_under(&unlimited.0);
        assert_eq!(limit.bytes, 16_384_000 * 1024);
        assert_eq!(limit.source, LimitSource::Physical);
    }

    #[test]
    fn a_limit_above_physical_memory_is_not_the_limit() {
        let tree = Tree::new(
            "above",
            &[
                ("proc/meminfo", MEMINFO),
                ("proc/self/cgroup", "0::/big\n"),
                ("sys/fs/cgroup/big/memory.max", "68719476736\n"),
            ],
        );
        assert_eq!(
            MemoryLimit::read_under(&tree.0).source,
            LimitSource::Physical
        );
    }

    #[test]
    fn nothing_readable_is_said_plainly() {
        let tree = Tree::new("empty", &[("proc/self/cgroup", "garbage")]);
        let limit = MemoryLimit::read_under(&tree.0);
        assert_eq!(limit.source, LimitSource::Assumed);
        assert_eq!(limit.bytes, ASSUMED);
    }

    #[test]
    fn this_process_has_a_limit() {
        let limit = MemoryLimit::of_this_process();
        assert!(limit.bytes > 0);
    }
}
