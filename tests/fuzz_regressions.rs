//! Replays the fuzz targets' kept inputs in the normal suite: the seeds
//! (`fuzz/seeds/`) and every input that once crashed a target
//! (`fuzz/regressions/`, added by `scripts/fuzz.sh`).

use std::path::Path;

use kvsync::fuzz_targets::TARGETS;

fn kept(dir: &str, target: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz")
        .join(dir)
        .join(target);
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .map(|e| std::fs::read(e.unwrap().path()).unwrap())
        .collect()
}

#[test]
fn kept_fuzz_inputs_replay_without_panicking() {
    for (target, run) in TARGETS {
        let seeds = kept("seeds", target);
        assert!(!seeds.is_empty(), "no seed for {target}");
        for input in seeds.iter().chain(&kept("regressions", target)) {
            run(input);
        }
    }
}

#[test]
fn seeds_are_the_valid_inputs_they_claim_to_be() {
    // The first byte of a snapshot seed picks the update size.
    let kvr1 = &kept("seeds", "kvr1")[0][1..];
    let mut v = kvsync::snapshot::kvr1::Kvr1Verifier::new(kvr1.len() as u64);
    v.update(kvr1).unwrap();
    assert_eq!(v.finish().unwrap().seq, 3);
    let rdb = &kept("seeds", "rdb")[0][1..];
    let head = kvsync::snapshot::rdb::parse_head(rdb).unwrap().unwrap();
    assert_eq!(head.repl_offset, Some(42));
    assert_eq!(head.repl_id.as_deref(), Some(&*"a".repeat(40)));
    for token in kept("seeds", "blk3_token") {
        kvsync::blk3::token::Token::decode(&token).unwrap();
    }
    let m = kvsync::snapshot::manifest::Manifest::decode(&kept("seeds", "manifest")[0]).unwrap();
    assert_eq!(
        (m.pieces(), m.info.repl_id.as_deref()),
        (3, Some(&*"a".repeat(40)))
    );
    let j = kvsync::store::journal::Journal::decode(&kept("seeds", "journal")[0]).unwrap();
    assert_eq!(j.verified, [true, false, true]);
    // The stream seeds: frames a session takes, and a log that opens.
    let session = kept("seeds", "stream_session").remove(0);
    let (first, _) = kvsync::blk3::token::Token::decode_frame(&session)
        .unwrap()
        .unwrap();
    assert!(matches!(
        first,
        kvsync::blk3::token::Token::Strm {
            offset: 1000,
            len: 5,
            ..
        }
    ));
    let log = &kept("seeds", "log_files")[0];
    let split = usize::from(u16::from_le_bytes([log[0], log[1]]));
    assert!(log[2..2 + split].starts_with(b"KVSLOG01"));
    assert!(serde_json::from_slice::<serde_json::Value>(&log[2 + split..]).is_ok());
    let getack = &kept("seeds", "getack")[0];
    assert!(String::from_utf8_lossy(getack).contains("GETACK"));
}
