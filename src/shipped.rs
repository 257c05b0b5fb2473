//! What the binary carries inside it — the demo job, its corpus and the stock policies — so
//! `headroom serve --demo` works from any directory, and how they are written out when missing.

use std::path::{Path, PathBuf};

use crate::config::JobSpec;

/// `data/demo-job.yaml` as shipped (its `data.path` is rewritten to where the corpus is).
pub const DEMO_JOB: &str = include_str!("../data/demo-job.yaml");
/// The demo's corpus file name and text (`data/shakespeare-tiny.txt`, ~1 MB).
pub const DEMO_CORPUS_NAME: &str = "shakespeare-tiny.txt";
pub const DEMO_CORPUS: &str = include_str!("../data/shakespeare-tiny.txt");
/// `policies/*.yaml` as shipped: (name, text).
pub const POLICIES: [(&str, &str); 4] = [
    ("default", include_str!("../policies/default.yaml")),
    ("micro-batch-only", include_str!("../policies/micro-batch-only.yaml")),
    ("no-offload", include_str!("../policies/no-offload.yaml")),
    ("seed-default", include_str!("../policies/seed-default.yaml")),
];

/// The demo job reading its corpus from `corpus`.
pub fn demo_job(corpus: &Path) -> JobSpec {
    let mut spec = JobSpec::parse(DEMO_JOB).expect("the shipped demo job is valid");
    spec.data.path = corpus.to_path_buf();
    spec
}

/// What `seed` will create: the policies directory (with the stock policies) when it is
/// missing, the data directory when it is missing, and the corpus when the data directory
/// lacks it. Decided before anything is created; `seed` then writes exactly this.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seed {
    pub policies_dir: Option<PathBuf>,
    pub data_dir: Option<PathBuf>,
    pub corpus: Option<PathBuf>,
}

impl Seed {
    /// What the demo needs of `policies` and `data` (the first data directory).
    pub fn for_demo(policies: &Path, data: &Path) -> Seed {
        let corpus = data.join(DEMO_CORPUS_NAME);
        Seed {
            policies_dir: (!policies.exists()).then(|| policies.to_path_buf()),
            data_dir: (!data.exists()).then(|| data.to_path_buf()),
            corpus: (!corpus.exists()).then_some(corpus),
        }
    }

    /// Write it; a line per thing written, for the user.
    pub fn write(&self) -> std::io::Result<Vec<String>> {
        let mut said = Vec::new();
        if let Some(dir) = &self.policies_dir {
            std::fs::create_dir_all(dir)?;
            for (name, text) in POLICIES {
                std::fs::write(dir.join(format!("{name}.yaml")), text)?;
            }
            let names: Vec<&str> = POLICIES.iter().map(|(n, _)| *n).collect();
            said.push(format!("created {} with the stock policies ({})", dir.display(), names.join(", ")));
        }
        if let Some(dir) = &self.data_dir {
            std::fs::create_dir_all(dir)?;
            said.push(format!("created {}", dir.display()));
        }
        if let Some(corpus) = &self.corpus {
            // Whole or not at all: a reader never sees half a corpus.
            let part = corpus.with_extension("part");
            std::fs::write(&part, DEMO_CORPUS)?;
            std::fs::rename(&part, corpus)?;
            said.push(format!("wrote the demo corpus to {}", corpus.display()));
        }
        Ok(said)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_files_parse_and_match_the_repository() {
        for (name, text) in POLICIES {
            let policy = crate::supervisor::policy::Policy::parse(text).unwrap();
            assert_eq!(policy.name, name);
        }
        let names: Vec<String> =
            crate::supervisor::policy::list(Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/policies")));
        assert_eq!(names, POLICIES.map(|(n, _)| n.to_string()), "every policy file is shipped");
        assert_eq!(demo_job(Path::new("/x/c.txt")).data.path, Path::new("/x/c.txt"));
    }

    #[test]
    fn the_demo_seeds_only_what_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        let (policies, data) = (dir.path().join("policies"), dir.path().join("data"));
        let seed = Seed::for_demo(&policies, &data);
        assert_eq!(seed.policies_dir.as_deref(), Some(policies.as_path()));
        assert_eq!(seed.corpus, Some(data.join(DEMO_CORPUS_NAME)));
        assert_eq!(seed.write().unwrap().len(), 3);
        assert_eq!(std::fs::read_to_string(data.join(DEMO_CORPUS_NAME)).unwrap(), DEMO_CORPUS);
        assert!(policies.join("default.yaml").is_file());
        assert_eq!(Seed::for_demo(&policies, &data), Seed::default(), "nothing left to write");
    }
}
