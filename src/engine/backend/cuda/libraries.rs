//! Where the CUDA libraries are: the files this process loaded (for `gpu-check`'s header and
//! bug reports), and, when one cannot be loaded, where a copy sits off the library path (the
//! usual places: a CUDA toolkit, pip's `nvidia-*` wheels in a virtual environment or conda).
//!
//! cudarc finds a library by name only (`libcublas.so`, `.so.13`, `.so.12`, ...) through the
//! dynamic loader, which reads LD_LIBRARY_PATH once at process start; so a copy found here is
//! reported with the folder to add, not loaded behind the user's back.

use std::path::{Path, PathBuf};

/// The CUDA libraries mapped into this process, as (file name stem, full path), e.g.
/// ("libcublas", "/venv/.../nvidia/cu13/lib/libcublas.so.13"). Linux only (reads
/// /proc/self/maps); empty elsewhere or before any library is loaded.
pub fn loaded() -> Vec<(&'static str, PathBuf)> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    loaded_in(&maps)
}

/// `loaded` on the text of a maps file.
fn loaded_in(maps: &str) -> Vec<(&'static str, PathBuf)> {
    const STEMS: [&str; 6] = ["libcuda", "libnvrtc", "libcublas", "libcublasLt", "libnccl", "libnvidia-ml"];
    let mut found: Vec<(&'static str, PathBuf)> = Vec::new();
    for path in maps.lines().filter_map(|line| line.split_whitespace().nth(5)) {
        let Some(file) = Path::new(path).file_name().and_then(|f| f.to_str()) else { continue };
        let Some(stem) =
            STEMS.iter().find(|stem| file.strip_prefix(**stem).is_some_and(|rest| rest.starts_with(".so")))
        else {
            continue;
        };
        if !found.iter().any(|(s, p)| s == stem && p == Path::new(path)) {
            found.push((stem, PathBuf::from(path)));
        }
    }
    found
}

/// Folders where CUDA libraries are commonly installed, most specific first: the toolkit, and
/// the `nvidia/*/lib` folders of pip wheels in the active virtual environment, conda, the
/// user's and the system's site-packages.
fn search_dirs() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(prefix) = std::env::var_os(var) {
            roots.push(PathBuf::from(prefix).join("lib"));
        }
    }
    if let Some(home) = std::env::var_os("HOME") {
        roots.push(PathBuf::from(home).join(".local/lib"));
    }
    roots.extend(["/usr/local/lib", "/usr/lib", "/opt/conda/lib"].map(PathBuf::from));
    let mut dirs: Vec<PathBuf> =
        ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"].into_iter().map(PathBuf::from).collect();
    for root in roots {
        // root/python3.X/{site,dist}-packages/nvidia/*/lib
        for python in subdirs(&root).filter(|d| name_of(d).starts_with("python3")) {
            for packages in ["site-packages", "dist-packages"] {
                dirs.extend(subdirs(&python.join(packages).join("nvidia")).map(|d| d.join("lib")));
            }
        }
    }
    dirs.retain(|d| d.is_dir());
    dirs
}

fn subdirs(dir: &Path) -> impl Iterator<Item = PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    found.sort();
    found.into_iter()
}

fn name_of(path: &Path) -> &str {
    path.file_name().and_then(|n| n.to_str()).unwrap_or("")
}

/// Copies of `soname_base` (e.g. "libcublas.so") of the major `versions` that are loaded (and
/// unversioned), in `dirs`.
fn find_in(dirs: &[PathBuf], soname_base: &str, versions: &[&str]) -> Vec<PathBuf> {
    let accepted: Vec<String> =
        std::iter::once(soname_base.to_string()).chain(versions.iter().map(|v| format!("{soname_base}.{v}"))).collect();
    dirs.iter().flat_map(|d| accepted.iter().map(move |n| d.join(n))).filter(|p| p.exists()).collect()
}

/// The tail of a "not found" message for `soname_base` of major `versions`: where a copy was
/// found off the library path and the folder to add, or which pip package provides it.
pub fn hint(soname_base: &str, versions: &[&str], pip_package: &str) -> String {
    let on_path: Vec<PathBuf> =
        std::env::var_os("LD_LIBRARY_PATH").map(|v| std::env::split_paths(&v).collect()).unwrap_or_default();
    hint_in(&search_dirs(), &on_path, soname_base, versions, pip_package)
}

/// `hint` with the folders to search and those on LD_LIBRARY_PATH given.
fn hint_in(dirs: &[PathBuf], on_path: &[PathBuf], soname_base: &str, versions: &[&str], pip_package: &str) -> String {
    match find_in(dirs, soname_base, versions).first() {
        Some(path) => {
            let dir = path.parent().unwrap_or(Path::new("/"));
            if on_path.iter().any(|p| p == dir) {
                // SAFETY: loading a CUDA library runs only its initialisers, as cudarc would.
                let why = match unsafe { libloading::Library::new(path) } {
                    Err(e) => std::error::Error::source(&e).map_or_else(|| e.to_string(), |s| s.to_string()),
                    Ok(_) => "it loads by its path but not by name".to_string(),
                };
                format!(": {} is on LD_LIBRARY_PATH but does not load: {why}", path.display())
            } else {
                format!(": found {}; add {} to LD_LIBRARY_PATH", path.display(), dir.display())
            }
        }
        None => format!(
            ": install the CUDA toolkit, or `pip install {pip_package}` and put its lib folder (under \
             site-packages/nvidia/, e.g. nvidia/cu13/lib) on LD_LIBRARY_PATH"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loaded_libraries_come_from_the_maps_text() {
        let maps = "\
7f00-7f10 r--p 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04
7f10-7f20 r-xp 00010000 08:01 1 /usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04
7f20-7f30 r--p 00000000 08:01 2 /venv/nvidia/cu13/lib/libcublasLt.so.13
7f30-7f40 r--p 00000000 08:01 3 /venv/nvidia/cu13/lib/libcublas.so.13
7f40-7f50 r--p 00000000 08:01 4 /venv/nvidia/cu13/lib/libnvrtc-builtins.so.13.0
7f50-7f60 rw-p 00000000 00:00 0
7f60-7f70 r--p 00000000 08:01 5 /usr/lib/libc.so.6";
        let found = loaded_in(maps);
        let names: Vec<String> = found.iter().map(|(s, p)| format!("{s}={}", p.display())).collect();
        assert_eq!(
            names,
            [
                "libcuda=/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04",
                "libcublasLt=/venv/nvidia/cu13/lib/libcublasLt.so.13",
                "libcublas=/venv/nvidia/cu13/lib/libcublas.so.13",
            ]
        );
    }

    #[test]
    fn a_copy_off_the_library_path_is_named_with_its_folder() {
        let root = tempfile::tempdir().unwrap();
        let cu13 = root.path().join("nvidia/cu13/lib");
        let old = root.path().join("nvidia/cuda_nvrtc/lib");
        std::fs::create_dir_all(&cu13).unwrap();
        std::fs::create_dir_all(&old).unwrap();
        std::fs::write(old.join("libnvrtc.so.11.2"), b"").unwrap();
        let dirs = [old.clone(), cu13.clone()];
        // CUDA 11's library is not one cudarc loads: not offered.
        let hint = hint_in(&dirs, &[], "libnvrtc.so", &["13", "12"], "nvidia-cuda-nvrtc");
        assert!(hint.contains("`pip install nvidia-cuda-nvrtc`"), "{hint}");
        std::fs::write(cu13.join("libnvrtc.so.13"), b"").unwrap();
        let lib = cu13.join("libnvrtc.so.13");
        let hint = hint_in(&dirs, &[], "libnvrtc.so", &["13", "12"], "nvidia-cuda-nvrtc");
        assert_eq!(hint, format!(": found {}; add {} to LD_LIBRARY_PATH", lib.display(), cu13.display()));
        // Already on the path but broken (here: an empty file): the loader's own reason.
        let hint = hint_in(&dirs, std::slice::from_ref(&cu13), "libnvrtc.so", &["13", "12"], "nvidia-cuda-nvrtc");
        assert!(hint.starts_with(&format!(": {} is on LD_LIBRARY_PATH but does not load: ", lib.display())), "{hint}");
        assert!(hint.contains("file too short"), "{hint}");
    }
}
