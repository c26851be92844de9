//! Finished syncs kept across restarts: the agent's recent syncs (newest
//! first, at most `[sync] keep_recent`) in `sync-history` in its
//! `state_dir` (never a KV's directory), as length-delimited
//! `SyncProgress` messages, written atomically after each sync ends and
//! read at start. A missing, unreadable or damaged file is an empty
//! history (what precedes the damage is kept): it never stops the agent.

use std::path::Path;

use prost::Message;

use crate::rpc::pb;

/// The history's file name in the agent's `state_dir`.
pub const FILE: &str = "sync-history";

/// The largest history read.
const MAX_BYTES: u64 = 4 << 20;

/// The history kept in `dir`, newest first, at most `keep` (empty when
/// there is none or it cannot be read).
pub fn load(dir: &Path, keep: usize) -> Vec<pb::SyncProgress> {
    let bytes = match crate::sys::fs::read_regular(&dir.join(FILE), MAX_BYTES) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot read the sync history: status starts without it");
            return Vec::new();
        }
    };
    let mut buf = bytes.as_slice();
    let mut out = Vec::new();
    while !buf.is_empty() && out.len() < keep {
        match pb::SyncProgress::decode_length_delimited(&mut buf) {
            Ok(p) => out.push(p),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "the sync history is damaged: what follows the damage is dropped");
                break;
            }
        }
    }
    out
}

/// Keeps `recent` (newest first) as the history in `dir`: those that fit
/// in what [`load`] reads, the text a peer sent with its controls escaped
/// (`kvsync status` prints it to a terminal).
pub fn save(dir: &Path, recent: &[pb::SyncProgress]) -> std::io::Result<()> {
    let mut bytes = Vec::new();
    for p in recent {
        let mut p = p.clone();
        for text in [&mut p.error, &mut p.last_error, &mut p.source] {
            *text = crate::peer_text::escape_controls(text).into_owned();
        }
        if (bytes.len() + p.encoded_len() + 10) as u64 > MAX_BYTES {
            // One that does not fit is left out, not the older ones.
            continue;
        }
        p.encode_length_delimited(&mut bytes)
            .expect("a Vec grows as needed");
    }
    crate::sys::fs::write_atomic(&dir.join(FILE), &bytes, (".sync-history-", ".tmp"), 0o600)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sync(id: &str) -> pb::SyncProgress {
        pb::SyncProgress {
            sync_id: id.into(),
            instance: "default".into(),
            error: "the source went away".into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_history_comes_back_as_it_was_kept_and_at_most_keep_of_it() {
        let dir = tempfile::tempdir().unwrap();
        assert!(load(dir.path(), 32).is_empty(), "none yet");
        let kept = vec![sync("b"), sync("a")];
        save(dir.path(), &kept).unwrap();
        assert_eq!(load(dir.path(), 32), kept);
        assert_eq!(load(dir.path(), 1), kept[..1]);
    }

    #[test]
    fn a_peers_text_is_kept_with_its_controls_escaped() {
        let dir = tempfile::tempdir().unwrap();
        let mut p = sync("a");
        p.error = "refused\u{1b}[2J by the source".into();
        save(dir.path(), &[p]).unwrap();
        let kept = load(dir.path(), 32);
        assert!(
            !crate::peer_text::has_control(&kept[0].error),
            "{:?}",
            kept[0].error
        );
    }

    #[test]
    fn one_entry_too_large_to_keep_is_left_out_not_the_older_ones() {
        let dir = tempfile::tempdir().unwrap();
        let mut huge = sync("b");
        huge.error = "x".repeat(MAX_BYTES as usize);
        save(dir.path(), &[huge, sync("a")]).unwrap();
        assert_eq!(load(dir.path(), 32), vec![sync("a")]);
    }

    #[test]
    fn a_damaged_history_keeps_what_precedes_the_damage() {
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), &[sync("b"), sync("a")]).unwrap();
        let path = dir.path().join(FILE);
        let mut bytes = std::fs::read(&path).unwrap();
        let first = sync("b").encoded_len() + 1;
        bytes.truncate(first + 3);
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(load(dir.path(), 32), vec![sync("b")]);
        std::fs::write(&path, [0xff; 16]).unwrap();
        assert!(load(dir.path(), 32).is_empty());
    }
}
