//! Strings that come from peers (snapshot names, node ids, replication ids)
//! are data, never syntax: this module says which names are acceptable where
//! they enter, and escapes what leaves for a file or a KV's admin port.

use std::borrow::Cow;

/// Longest name accepted from a peer.
pub const MAX_NAME: usize = 128;

/// A plain name: 1..=128 of `[A-Za-z0-9._-]`, not starting with `.` (no
/// hidden files, no `..`). Nothing else a peer sends is used as a name.
pub fn is_plain_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_NAME
        && !s.starts_with('.')
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// True when `s` holds a control character (CR, LF, NUL, ESC, …): such a
/// value must not reach a line-based protocol.
pub fn has_control(s: &str) -> bool {
    s.chars().any(char::is_control)
}

/// `s` with every control character written as `\u{..}`, for one-line
/// `key value` records.
pub fn escape_controls(s: &str) -> Cow<'_, str> {
    if !has_control(s) {
        return Cow::Borrowed(s);
    }
    Cow::Owned(
        s.chars()
            .map(|c| {
                if c.is_control() {
                    c.escape_unicode().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_only() {
        for good in ["snap-5.kvr1", "dump.rdb", "node_1.example-2"] {
            assert!(is_plain_name(good), "{good}");
        }
        let long = "a".repeat(MAX_NAME + 1);
        for bad in [
            "",
            ".hidden",
            "..",
            "../etc/passwd",
            "a/b",
            "x.kvr1\r\nFLUSHALL",
            "with space.kvr1",
            "nul\0.kvr1",
            "snap\u{2215}5.kvr1", // a look-alike of '/'
            long.as_str(),
        ] {
            assert!(!is_plain_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn controls_are_escaped_and_plain_text_is_kept() {
        assert_eq!(escape_controls("abc def"), "abc def");
        let e = escape_controls("x\r\nFLUSHALL");
        assert!(!has_control(&e), "{e}");
        assert_eq!(e, "x\\u{d}\\u{a}FLUSHALL");
    }
}
