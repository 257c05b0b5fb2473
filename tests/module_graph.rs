//! The module graph of src/, built from the `use` statements and `crate::` / `super::` paths of
//! every file (its in-file `mod tests` left out): no import cycle between files, none between
//! the folders and files one level below the crate's top modules (`engine::backend`,
//! `engine::model`, `supervisor::db`, ...), and the layering the architecture promises (the
//! engine never reaches the supervisor or the CLI, the supervisor reaches the engine only through
//! its estimator).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module path (`["engine", "backend", "view"]`) of every source file.
fn modules(src: &Path) -> BTreeMap<Vec<String>, PathBuf> {
    fn walk(dir: &Path, prefix: &[String], out: &mut BTreeMap<Vec<String>, PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let path = entry.path();
            let name = path.file_stem().unwrap().to_string_lossy().to_string();
            if path.is_dir() {
                let mut p = prefix.to_vec();
                p.push(name);
                walk(&path, &p, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let mut p = prefix.to_vec();
                if name == "main" {
                    continue;
                }
                if !matches!(name.as_str(), "mod" | "lib") {
                    p.push(name);
                }
                out.insert(p, path);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(src, &[], &mut out);
    out
}

/// The code of a file without comments and without its in-file test module.
fn code(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let t = line.trim_start();
        if t == "#[cfg(test)]" && lines.peek().is_some_and(|l| l.trim_start().starts_with("mod tests")) {
            break;
        }
        if t.starts_with("//") {
            continue;
        }
        out.push_str(line.split(" // ").next().unwrap());
        out.push('\n');
    }
    out
}

/// Expand a use tree (`a::{b, c::{d, self}}`) into its paths.
fn expand(tree: &str) -> Vec<String> {
    let tree: String = tree.chars().filter(|c| !c.is_whitespace()).collect();
    let Some(open) = tree.find('{') else { return vec![tree] };
    let prefix = &tree[..open];
    let inner = &tree[open + 1..tree.len() - 1];
    let (mut parts, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts
        .into_iter()
        .filter(|p| !p.is_empty())
        .flat_map(|p| expand(p).into_iter().map(move |q| format!("{prefix}{q}")))
        .collect()
}

/// Every `crate::` / `super::` path a file's code names.
fn paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    for stmt in code.split(';') {
        let s = stmt.trim();
        let s = s.strip_prefix("pub ").or_else(|| s.strip_prefix("pub(crate) ")).unwrap_or(s);
        if let Some(tree) = s.strip_prefix("use ") {
            out.extend(expand(tree));
        }
    }
    let bytes = code.as_bytes();
    for anchor in ["crate::", "super::"] {
        for (i, _) in code.match_indices(anchor) {
            if i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_' || bytes[i - 1] == b':') {
                continue;
            }
            let end = code[i..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .map_or(code.len(), |e| i + e);
            out.push(code[i..end].trim_end_matches(':').to_string());
        }
    }
    out
}

/// The module a path names: the longest prefix that is a source file.
fn resolve(path: &str, from: &[String], mods: &BTreeMap<Vec<String>, PathBuf>) -> Option<Vec<String>> {
    let mut segs: Vec<&str> = path.split("::").collect();
    let mut base: Vec<String> = match segs.first() {
        Some(&"crate") => {
            segs.remove(0);
            Vec::new()
        }
        Some(&"super") => {
            // `super` of module a::b (a/b.rs, or a/b/mod.rs) is a.
            let mut b = from.to_vec();
            while segs.first() == Some(&"super") {
                segs.remove(0);
                b.pop();
            }
            b
        }
        _ => return None,
    };
    for s in segs {
        if s == "self" || s == "*" {
            continue;
        }
        let mut next = base.clone();
        next.push(s.to_string());
        if mods.contains_key(&next) {
            base = next;
        } else {
            break;
        }
    }
    Some(base)
}

struct Graph {
    edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
}

impl Graph {
    fn build() -> Graph {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mods = modules(&src);
        let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
        for (module, file) in &mods {
            let text = std::fs::read_to_string(file).unwrap();
            for p in paths(&code(&text)) {
                let Some(target) = resolve(&p, module, &mods) else { continue };
                // A module's own declarations and re-exports of what is below it are not
                // dependencies; nor is naming itself.
                if target.starts_with(module) {
                    continue;
                }
                edges.entry(module.clone()).or_default().insert(target);
            }
        }
        Graph { edges }
    }

    /// The graph with every module cut to its first `depth` segments (self-loops dropped).
    fn coarse(&self, depth: usize) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
        let cut = |m: &Vec<String>| m[..m.len().min(depth)].to_vec();
        let mut out: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
        for (from, tos) in &self.edges {
            for to in tos {
                let (a, b) = (cut(from), cut(to));
                if a != b && !b.starts_with(&a) && !a.starts_with(&b) {
                    out.entry(a).or_default().insert(b);
                }
            }
        }
        out
    }
}

/// A cycle of `edges`, if there is one, as the modules along it.
fn find_cycle(edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Option<Vec<String>> {
    fn visit(
        n: &Vec<String>,
        edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        state: &mut BTreeMap<Vec<String>, u8>,
        stack: &mut Vec<Vec<String>>,
    ) -> Option<Vec<String>> {
        state.insert(n.clone(), 1);
        stack.push(n.clone());
        for m in edges.get(n).into_iter().flatten() {
            match state.get(m) {
                Some(1) => {
                    let at = stack.iter().position(|s| s == m).unwrap();
                    return Some(stack[at..].iter().chain([m]).map(|s| s.join("::")).collect());
                }
                Some(_) => {}
                None => {
                    if let Some(c) = visit(m, edges, state, stack) {
                        return Some(c);
                    }
                }
            }
        }
        stack.pop();
        state.insert(n.clone(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in edges.keys() {
        if !state.contains_key(n) {
            if let Some(c) = visit(n, edges, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

#[test]
fn no_import_cycle_between_files_or_between_folders() {
    let g = Graph::build();
    assert!(g.edges.len() > 30, "the graph was read: {} modules with imports", g.edges.len());
    assert!(
        g.edges[&vec!["engine".to_string(), "train".into(), "job".into()]].contains(&vec!["protocol".to_string()]),
        "the job loop's import of the protocol is seen"
    );
    if let Some(c) = find_cycle(&g.edges) {
        panic!("import cycle between files: {}", c.join(" → "));
    }
    for depth in [1, 2] {
        if let Some(c) = find_cycle(&g.coarse(depth)) {
            panic!("import cycle between modules at depth {depth}: {}", c.join(" → "));
        }
    }
}

#[test]
fn the_layers_keep_to_their_side() {
    let g = Graph::build();
    let top = g.coarse(1);
    let reaches = |a: &str, b: &str| top.get(&vec![a.to_string()]).is_some_and(|s| s.contains(&vec![b.to_string()]));
    for (from, to) in [("engine", "supervisor"), ("engine", "cli"), ("supervisor", "cli"), ("protocol", "engine")] {
        assert!(!reaches(from, to), "{from} must not depend on {to}: {:?}", top.get(&vec![from.to_string()]));
    }
    assert!(reaches("engine", "protocol") && reaches("supervisor", "protocol"), "both sides speak through protocol");
    // The supervisor reaches the engine only through its estimator (a pure function of a job
    // spec, for admission and planning): never its passes, backends or trainer.
    for (from, tos) in &g.edges {
        for to in tos.iter().filter(|t| from[0] == "supervisor" && t[0] == "engine") {
            assert!(to.len() >= 2 && to[1] == "estimate", "{} imports {}", from.join("::"), to.join("::"));
        }
    }
}

#[test]
fn the_graph_reader_sees_cycles_and_use_trees() {
    assert_eq!(
        expand("crate::engine::{self, backend::{View, ViewMut}, train::job::Events}"),
        [
            "crate::engine::self",
            "crate::engine::backend::View",
            "crate::engine::backend::ViewMut",
            "crate::engine::train::job::Events"
        ]
    );
    let v = |s: &str| s.split("::").map(str::to_string).collect::<Vec<_>>();
    let mut edges = BTreeMap::new();
    edges.insert(v("a"), BTreeSet::from([v("b")]));
    edges.insert(v("b"), BTreeSet::from([v("c")]));
    assert_eq!(find_cycle(&edges), None);
    edges.insert(v("c"), BTreeSet::from([v("a")]));
    assert_eq!(find_cycle(&edges), Some(vec!["a".into(), "b".into(), "c".into(), "a".into()]));
}
