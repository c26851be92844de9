//! The layer table of docs/ARCHITECTURE.md ("Modules and layering") is the
//! source of truth for which module may use which, and this test holds the
//! code to it: every top-level module of `src/` is in exactly one layer, and
//! production code (not `#[cfg(test)]` modules or `tests.rs` files) only
//! names modules of its own layer or of layers below it. `blk3` uses no
//! other module and nothing that does I/O or reads a clock.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Each top-level module's layer, top (0) down, from the table.
fn layers() -> BTreeMap<String, (usize, String)> {
    let doc = std::fs::read_to_string(Path::new(ROOT).join("docs/ARCHITECTURE.md")).unwrap();
    let section = doc
        .split("## Modules and layering")
        .nth(1)
        .expect("docs/ARCHITECTURE.md has a \"Modules and layering\" section");
    let mut map = BTreeMap::new();
    let rows = section
        .lines()
        .skip_while(|l| !l.starts_with("| layer"))
        .skip(2)
        .take_while(|l| l.starts_with('|'));
    for (depth, row) in rows.enumerate() {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let (layer, modules) = (cells[1], cells[2]);
        // Submodules stand in parentheses after their module.
        let mut top = String::new();
        let mut nesting = 0;
        for c in modules.chars() {
            match c {
                '(' => nesting += 1,
                ')' => nesting -= 1,
                _ if nesting == 0 => top.push(c),
                _ => {}
            }
        }
        for name in top.split('`').skip(1).step_by(2) {
            let old = map.insert(name.to_string(), (depth, layer.to_string()));
            assert!(old.is_none(), "{name} is in two layers of the table");
        }
    }
    assert!(map.len() > 5, "no layer table found: {map:?}");
    map
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The top-level module a file of `src/` belongs to (`None` for lib.rs).
fn module_of(file: &Path) -> Option<String> {
    let rel = file.strip_prefix(Path::new(ROOT).join("src")).unwrap();
    let first = rel.components().next()?.as_os_str().to_str()?.to_string();
    let name = first.strip_suffix(".rs").unwrap_or(&first).to_string();
    (name != "lib").then_some(name)
}

/// The production lines of a file, numbered: comments and test code left out.
fn production_lines(file: &Path) -> Vec<(usize, String)> {
    if file.file_name().is_some_and(|n| n == "tests.rs") {
        return Vec::new();
    }
    let text = std::fs::read_to_string(file).unwrap();
    text.lines()
        .enumerate()
        .take_while(|(_, l)| l.trim() != "#[cfg(test)]")
        .filter(|(_, l)| !l.trim_start().starts_with("//"))
        .map(|(i, l)| (i + 1, l.to_string()))
        .collect()
}

/// The crate modules a line names (`crate::X`, or `kvsync::X` in main.rs).
fn named_modules(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    for prefix in ["crate::", "kvsync::"] {
        let mut rest = line;
        while let Some(at) = rest.find(prefix) {
            let before = rest[..at].chars().last();
            rest = &rest[at + prefix.len()..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.push(name);
            }
        }
    }
    out
}

/// Every module of `src/` whose production code names a module of a higher
/// layer, as `file:line: from (layer) -> to (layer)`.
fn violations(layers: &BTreeMap<String, (usize, String)>) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(&Path::new(ROOT).join("src"), &mut files);
    files.sort();
    let mut found = Vec::new();
    for file in &files {
        let Some(from) = module_of(file) else {
            continue;
        };
        let Some((depth, layer)) = layers.get(&from) else {
            found.push(format!(
                "{}: module {from} is in no layer of the table",
                file.display()
            ));
            continue;
        };
        for (n, line) in production_lines(file) {
            for to in named_modules(&line) {
                if to == from {
                    continue;
                }
                match layers.get(&to) {
                    Some((d, l)) if d < depth => found.push(format!(
                        "{}:{n}: {from} ({layer}) uses {to} ({l}), a higher layer",
                        file.display()
                    )),
                    Some(_) => {}
                    None => found.push(format!(
                        "{}:{n}: {to} is in no layer of the table",
                        file.display()
                    )),
                }
                if from == "blk3" {
                    found.push(format!("{}:{n}: blk3 uses {to}", file.display()));
                }
            }
            if from == "blk3" {
                for io in [
                    "tokio",
                    "std::net",
                    "std::fs",
                    "Instant",
                    "SystemTime",
                    "libc",
                    "rdma_sys",
                    "socket2",
                    "std::thread",
                ] {
                    if line.contains(io) {
                        found.push(format!("{}:{n}: blk3 uses {io}", file.display()));
                    }
                }
            }
        }
    }
    found
}

#[test]
fn every_module_keeps_to_the_layer_table() {
    let layers = layers();
    let found = violations(&layers);
    assert!(found.is_empty(), "layering broken:\n{}", found.join("\n"));
    // Every module in the table exists.
    for name in layers.keys() {
        let src = Path::new(ROOT).join("src");
        assert!(
            src.join(format!("{name}.rs")).exists() || src.join(name).is_dir(),
            "the table names {name}, which src/ does not have"
        );
    }
}

/// Each module's submodules as the table lists them in parentheses.
fn listed_submodules() -> BTreeMap<String, BTreeSet<String>> {
    let doc = std::fs::read_to_string(Path::new(ROOT).join("docs/ARCHITECTURE.md")).unwrap();
    let table = doc.split("## Modules and layering").nth(1).unwrap();
    let mut map = BTreeMap::new();
    for row in table
        .lines()
        .skip_while(|l| !l.starts_with("| layer"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
    {
        let modules = row.split('|').nth(2).unwrap();
        let mut rest = modules;
        while let Some(open) = rest.find('(') {
            let module = rest[..open].rsplit('`').nth(1).unwrap().to_string();
            let close = rest[open..].find(')').unwrap() + open;
            let subs = rest[open + 1..close]
                .split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_string)
                .collect();
            map.insert(module, subs);
            rest = &rest[close + 1..];
        }
    }
    map
}

/// The submodules `src/NAME/` holds: its `.rs` files other than `mod.rs`
/// and `tests.rs`, its folders with a `mod.rs`, and the modules its
/// `mod.rs` writes inline.
fn submodules_in_src(name: &str) -> BTreeSet<String> {
    let dir = Path::new(ROOT).join("src").join(name);
    let mut found = BTreeSet::new();
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return found;
    };
    for e in entries {
        let e = e.unwrap();
        let file = e.file_name().to_string_lossy().into_owned();
        if e.path().join("mod.rs").is_file() {
            found.insert(file.clone());
        }
        if let Some(stem) = file.strip_suffix(".rs") {
            if stem != "mod" && stem != "tests" {
                found.insert(stem.to_string());
            }
        }
    }
    let root = std::fs::read_to_string(dir.join("mod.rs")).unwrap_or_default();
    for line in root.lines() {
        if let Some(inline) = line
            .strip_prefix("pub mod ")
            .and_then(|l| l.strip_suffix(" {"))
        {
            found.insert(inline.to_string());
        }
    }
    found
}

#[test]
fn the_table_lists_every_submodule_and_only_those() {
    let listed = listed_submodules();
    for name in layers().keys() {
        let have = submodules_in_src(name);
        let said = listed.get(name).cloned().unwrap_or_default();
        assert_eq!(
            said, have,
            "docs/ARCHITECTURE.md lists {name}'s submodules as {said:?}; src/{name}/ has {have:?}"
        );
    }
}

#[test]
fn the_check_sees_a_forbidden_import() {
    let layers = layers();
    assert!(layers["store"].0 > layers["transport"].0);
    // The instance composes the jobs' parts: the snapshot jobs above it,
    // the stream below it, never the other way.
    assert!(layers["sync"].0 < layers["instance"].0);
    assert!(layers["instance"].0 < layers["stream"].0);
    assert_eq!(named_modules("use crate::transport::tcp;"), ["transport"]);
    assert_eq!(
        named_modules("x = kvsync::cli::run(crate::store::cache::X);"),
        ["store", "cli"]
    );
    assert!(named_modules("use mycrate::transport;").is_empty());
}
