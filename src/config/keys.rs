//! Settings the schema does not know: a file is read once with every key
//! it does not know collected (`serde_ignored`), and all of them are
//! reported together in the file's line order, each with its line, so a
//! config with several typos is fixed in one pass.

use std::collections::HashMap;

/// Deserializes `text`, collecting the path of every key no setting takes
/// (`grpc.lisen`, `instance.0.stream.upstrem`).
pub(super) fn parse<T: serde::de::DeserializeOwned>(
    text: &str,
) -> Result<(T, Vec<String>), String> {
    let mut unknown = Vec::new();
    let de = toml::Deserializer::parse(text).map_err(|e| e.to_string())?;
    let value = serde_ignored::deserialize(de, |path| unknown.push(path.to_string()))
        .map_err(|e| e.to_string())?;
    Ok((value, unknown))
}

/// One message naming every key of `unknown` with its line in `text`, in
/// line order.
pub(super) fn report(text: &str, unknown: &[String]) -> String {
    let mut found: Vec<(Option<usize>, &String)> =
        unknown.iter().map(|k| (line_of(text, k), k)).collect();
    found.sort_by_key(|(line, _)| line.unwrap_or(usize::MAX));
    let listed: Vec<String> = found
        .iter()
        .map(|(line, k)| match line {
            Some(n) => format!("line {n}: `{k}`"),
            None => format!("`{k}`"),
        })
        .collect();
    format!(
        "unknown settings (a typo, or a setting this version does not have): {}",
        listed.join(", ")
    )
}

/// The line (from 1) where `path` is set: its key under its table's
/// header (or the header, for a whole table), the n-th `[[x]]` of an array
/// of tables counting from 0. `None` when the file writes it another way
/// (an inline table, a dotted key).
fn line_of(text: &str, path: &str) -> Option<usize> {
    let mut table: Vec<String> = Vec::new();
    let mut arrays: HashMap<String, usize> = HashMap::new();
    for (n, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if let Some(name) = line.strip_prefix("[[").and_then(|l| l.split("]]").next()) {
            let name = name.trim().to_string();
            arrays
                .entry(name.clone())
                .and_modify(|i| *i += 1)
                .or_insert(0);
            table = resolve(&name, &arrays);
        } else if let Some(name) = line.strip_prefix('[').and_then(|l| l.split(']').next()) {
            table = resolve(name.trim(), &arrays);
        } else if let Some((key, _)) = line.split_once('=') {
            let mut at = table.clone();
            at.push(key.trim().to_string());
            if at.join(".") == path {
                return Some(n + 1);
            }
            continue;
        } else {
            continue;
        }
        // A whole table no setting takes: its header's line.
        if table.join(".") == path {
            return Some(n + 1);
        }
    }
    None
}

/// A header's dotted name as a path: each prefix that names an array of
/// tables takes its latest item's index.
fn resolve(name: &str, arrays: &HashMap<String, usize>) -> Vec<String> {
    let mut path = Vec::new();
    let mut prefix = String::new();
    for part in name.split('.').map(str::trim) {
        if !prefix.is_empty() {
            prefix.push('.');
        }
        prefix.push_str(part);
        path.push(part.to_string());
        if let Some(i) = arrays.get(&prefix) {
            path.push(i.to_string());
        }
    }
    path
}
