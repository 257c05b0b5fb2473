//! Memory categories and the counters the pool keeps per category (current, peak, window peak).

use serde::Serialize;
use std::fmt;

/// What a device allocation is for. Names are the contract used in telemetry, DB and web page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Category {
    Params,
    Grads,
    Optimizer,
    Activations,
    Workspace,
    /// Keys and values of earlier tokens kept by incremental decoding (inference only).
    KvCache,
}

/// How many categories there are: the length of every per-category array.
pub const CATEGORIES: usize = 6;

impl Category {
    pub const ALL: [Category; CATEGORIES] = [
        Category::Params,
        Category::Grads,
        Category::Optimizer,
        Category::Activations,
        Category::Workspace,
        Category::KvCache,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Category::Params => "params",
            Category::Grads => "grads",
            Category::Optimizer => "optimizer",
            Category::Activations => "activations",
            Category::Workspace => "workspace",
            Category::KvCache => "kv_cache",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Category {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Counters of one pool. `window_*` peaks restart at [`MemStats::reset_window`] (once per step).
#[derive(Debug, Clone, Default)]
pub struct MemStats {
    pub capacity: usize,
    pub current: [usize; CATEGORIES],
    pub peak: [usize; CATEGORIES],
    pub window_peak: [usize; CATEGORIES],
    pub reserved: usize,
    pub peak_allocated: usize,
    pub peak_reserved: usize,
    pub window_peak_allocated: usize,
    pub window_peak_reserved: usize,
    /// What each category held, and what the pool reserved, at the moment the window's
    /// allocated total peaked: a composition whose sum is `window_peak_allocated` (the
    /// per-category window peaks may come from different moments and sum to more).
    pub window_at_peak: [usize; CATEGORIES],
    pub window_reserved_at_peak: usize,
    pub host: [usize; CATEGORIES],
    /// Host-bytes peaks: lifetime and current window.
    pub host_peak: [usize; CATEGORIES],
    pub host_window_peak: [usize; CATEGORIES],
    pub num_allocs: u64,
    pub num_frees: u64,
    pub num_ooms: u64,
    pub num_segments: usize,
    /// Times the pool took memory from its source: a segment reserved (`cuMemAlloc` on cuda)
    /// or a run of arena pages mapped (`cuMemMap`). Each is a driver call that may synchronise
    /// the device; after a training step's first run the cache serves every request, so a
    /// steady-state step adds none.
    pub num_reserves: u64,
    /// Requests the caching allocator served by searching its free blocks.
    pub num_searches: u64,
    /// Requests the static plan served (no search), and those it could not (the caching
    /// allocator served them).
    pub num_planned: u64,
    pub num_plan_misses: u64,
    /// The largest free block cached in the pool (filled by `Pool::stats`).
    pub largest_free_block: usize,
}

impl MemStats {
    pub fn allocated(&self) -> usize {
        self.current.iter().sum()
    }

    pub fn current(&self, c: Category) -> usize {
        self.current[c.index()]
    }

    pub fn peak(&self, c: Category) -> usize {
        self.peak[c.index()]
    }

    /// The category's peak since the window was last reset.
    pub fn window_peak(&self, c: Category) -> usize {
        self.window_peak[c.index()]
    }

    pub fn host(&self, c: Category) -> usize {
        self.host[c.index()]
    }

    pub fn fragmentation(&self) -> usize {
        self.reserved.saturating_sub(self.allocated())
    }

    pub(crate) fn add(&mut self, c: Category, bytes: usize) {
        let i = c.index();
        self.current[i] += bytes;
        self.peak[i] = self.peak[i].max(self.current[i]);
        self.window_peak[i] = self.window_peak[i].max(self.current[i]);
        let allocated = self.allocated();
        self.peak_allocated = self.peak_allocated.max(allocated);
        if allocated > self.window_peak_allocated {
            self.window_peak_allocated = allocated;
            self.window_at_peak = self.current;
            self.window_reserved_at_peak = self.reserved;
        }
    }

    pub(crate) fn sub(&mut self, c: Category, bytes: usize) {
        self.current[c.index()] -= bytes;
    }

    pub(crate) fn bump_reserved_peak(&mut self) {
        self.peak_reserved = self.peak_reserved.max(self.reserved);
        self.window_peak_reserved = self.window_peak_reserved.max(self.reserved);
    }

    pub(crate) fn reset_window(&mut self) {
        self.window_peak = self.current;
        self.window_peak_allocated = self.allocated();
        self.window_peak_reserved = self.reserved;
        self.window_at_peak = self.current;
        self.window_reserved_at_peak = self.reserved;
        self.host_window_peak = self.host;
    }

    pub(crate) fn set_host(&mut self, c: Category, bytes: usize) {
        let i = c.index();
        self.host[i] = bytes;
        self.host_peak[i] = self.host_peak[i].max(bytes);
        self.host_window_peak[i] = self.host_window_peak[i].max(bytes);
    }

    pub fn summary(&self, device: &str, segments: usize, free_blocks: usize) -> String {
        let mut s = String::new();
        let line = "|---------------------------------------------------------------|\n";
        s.push_str(line);
        s.push_str(&format!("| memory summary: {:<45} |\n", device));
        s.push_str(line);
        s.push_str(&format!("| {:<20} | {:>18} | {:>18} |\n", "category", "current", "peak"));
        s.push_str(line);
        for c in Category::ALL {
            s.push_str(&format!(
                "| {:<20} | {:>18} | {:>18} |\n",
                c.name(),
                format_bytes(self.current(c)),
                format_bytes(self.peak(c))
            ));
        }
        s.push_str(line);
        let rows = [
            ("allocated", format_bytes(self.allocated()), format_bytes(self.peak_allocated)),
            ("reserved", format_bytes(self.reserved), format_bytes(self.peak_reserved)),
            ("fragmentation", format_bytes(self.fragmentation()), String::new()),
            ("capacity", format_bytes(self.capacity), String::new()),
            ("segments / free blks", format!("{segments} / {free_blocks}"), String::new()),
            ("allocs / frees", format!("{} / {}", self.num_allocs, self.num_frees), String::new()),
            ("ooms", self.num_ooms.to_string(), String::new()),
        ];
        for (name, cur, peak) in rows {
            s.push_str(&format!("| {:<20} | {:>18} | {:>18} |\n", name, cur, peak));
        }
        s.push_str(line);
        s
    }
}

/// "12.3 MiB" style formatting.
pub fn format_bytes(bytes: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

/// Parse "512MiB", "1.5GiB", "300MB", "1048576" into bytes.
pub fn parse_bytes(text: &str) -> Result<usize, String> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num.parse().map_err(|_| format!("`{text}` is not a size like 512MiB"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mib" => 1024.0 * 1024.0,
        "g" | "gb" => 1e9,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tb" => 1e12,
        "tib" => 1024f64.powi(4),
        other => return Err(format!("unknown size unit `{other}` in `{text}` (use B, KiB, MiB, GiB, KB, MB, GB)")),
    };
    let bytes = value * mult;
    if !bytes.is_finite() || bytes < 1.0 {
        return Err(format!("`{text}` must be a positive size"));
    }
    Ok(bytes as usize)
}
