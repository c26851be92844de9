//! Fault injection for the fault tests: the named points at which an
//! agent breaks its own data plane on purpose (`KVSYNC_FAULTS`), read once
//! by [`load`] at the agent's start and asked for where the fault happens
//! through [`active`], never handed down through the layers above the transport.
//! Builds without the cargo feature `faults` compile them out: [`active`]
//! is then a constant with no fault set, and `KVSYNC_FAULTS` is ignored
//! with a warning.
//!
//! The transport's own seams (an emulated queue pair's [`EmuFaults`], an
//! RDMA driver's [`RdmaFaults`], [`super::Serve`]'s faults) stay parameters:
//! the transport's unit tests set them per session.

use super::emulated::EmuFaults;
use super::rdma::RdmaFaults;
use super::ring::HeaderLie;
#[cfg(feature = "faults")]
use std::sync::atomic::{AtomicPtr, Ordering};

/// No fault.
const NONE: Faults = Faults {
    emu: EmuFaults {
        drop_send: None,
        delay_send: None,
        corrupt_at: None,
        cut_after: None,
    },
    rdma: RdmaFaults {
        bad_rkey: false,
        no_file_mr: false,
        damage_piece: None,
        hold_after: None,
        hold_file: None,
        write_after_verify: false,
    },
    corrupt_at: None,
    forge_at: None,
    stall_after: None,
    cut_after: None,
    cut_stream: None,
    handshake_ms: None,
    stream_corrupt_at: None,
    stream_ack_on_tick: false,
    stream_ring_lie: None,
};

/// The faults [`active`] answers: null for none, else a set [`install`]
/// leaked (never freed).
#[cfg(feature = "faults")]
static ACTIVE: AtomicPtr<Faults> = AtomicPtr::new(std::ptr::null_mut());

/// Reads `KVSYNC_FAULTS` and, when it is set, makes it what [`active`]
/// answers (the agent, at its start); returns what is active.
pub fn load() -> Result<&'static Faults, FaultsError> {
    let spec = std::env::var("KVSYNC_FAULTS").ok();
    let faults = Faults::read(spec.as_deref())?;
    #[cfg(feature = "faults")]
    if spec.is_some() {
        return Ok(install(faults));
    }
    drop(faults);
    Ok(active())
}

/// Makes `faults` what [`active`] answers from now on, in this whole
/// process (an in-process fault test sets its case's). Each set is leaked:
/// a process installs a handful.
#[cfg(feature = "faults")]
pub fn install(faults: Faults) -> &'static Faults {
    let faults: &'static mut Faults = Box::leak(Box::new(faults));
    ACTIVE.store(faults, Ordering::Release);
    faults
}

/// The faults this process injects: none until [`load`] or [`install`],
/// and none ever in a build without the `faults` feature.
pub fn active() -> &'static Faults {
    #[cfg(feature = "faults")]
    {
        let set = ACTIVE.load(Ordering::Acquire);
        // SAFETY: a non-null pointer in ACTIVE came from `Box::leak` in
        // `install`, so it is aligned, initialised and never freed, and
        // nothing writes through it after the store that published it.
        if let Some(faults) = unsafe { set.as_ref() } {
            return faults;
        }
    }
    &NONE
}

/// XORed into a message anywhere, these 5 bytes leave its CRC32 (IEEE)
/// unchanged: they are the generator polynomial 0x104c11db7 in the
/// reflected bit order, a multiple of the generator. What a forger or an
/// on-path attacker changes when CRC32 is the check (tests, `forge_at`).
pub const CRC32_NEUTRAL: [u8; 5] = [0x41, 0x06, 0x71, 0xdb, 0x01];

/// Faults injected into the data plane for fault tests, from the
/// `KVSYNC_FAULTS` environment variable: `corrupt_at=N,forge_at=N,
/// stall_after=N,cut_after=N,cut_stream=N` for TCP sources; `handshake_ms=N`
/// for TCP replicas; `stream_corrupt_at=N` for
/// stream sources; `stream_ack_on_tick=1` for stream replicas; `rdma_corrupt_at=N,rdma_cut_after=N,rdma_drop_send=N` for
/// the emulated fabric; `rdma_bad_rkey=1` and `rdma_hold_after=N` with
/// `hold_file=PATH`, `rdma_write_after_verify=1` (source), `rdma_no_file_mr=1`
/// and `rdma_damage_piece=N`
/// (replica) for the RDMA driver; `stream_ring_lie=1|2` (a stream source's
/// first ring session: a wrong magic, a sequence that goes back). Read only by builds with the cargo
/// feature `faults` (the test suite's); the agent logs loudly when any is
/// active.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Faults {
    /// Emulated-fabric faults.
    pub emu: EmuFaults,
    /// RDMA driver faults.
    pub rdma: RdmaFaults,
    /// Source: flip one bit of the snapshot byte at this offset on the wire.
    pub corrupt_at: Option<u64>,
    /// Source: XOR [`CRC32_NEUTRAL`] into the snapshot at this offset on
    /// the wire, every time (an on-path change CRC32 cannot see).
    pub forge_at: Option<u64>,
    /// Source: stop sending after this many bulk bytes (until the peer leaves).
    pub stall_after: Option<u64>,
    /// Source: drop the connection after this many bulk bytes.
    pub cut_after: Option<u64>,
    /// Source: `stall_after` and `cut_after` stop only this stream of a
    /// session on several (numbered from 0 as they connect).
    pub cut_stream: Option<u32>,
    /// Replica: its TCP data connections' handshakes count as this many
    /// milliseconds (a long link on loopback, for `tcp_streams = "auto"`).
    pub handshake_ms: Option<u64>,
    /// Stream source: flip one bit of the replication stream's byte at
    /// this offset on the wire, after its frame's MAC was made (an on-path
    /// change), in every session that sends it.
    pub stream_corrupt_at: Option<u64>,
    /// Stream replica: acknowledge what the log holds only once a second,
    /// not after every frame (a slow replica: the source's credit window
    /// fills while the replica still reads).
    pub stream_ack_on_tick: bool,
    /// Stream source over an RDMA ring: lie in the ring's header of the
    /// agent's first ring session (1: a wrong magic, 2: a sequence that
    /// goes back).
    pub stream_ring_lie: Option<HeaderLie>,
}

/// A `KVSYNC_FAULTS` that does not parse.
#[derive(Debug, thiserror::Error)]
pub enum FaultsError {
    #[error("fault {0:?} is not key=value")]
    NotKeyValue(String),
    #[error("fault {key}: {value:?} is not a byte offset")]
    NotANumber { key: String, value: String },
    #[error("unknown fault {0:?}")]
    Unknown(String),
}

impl Faults {
    /// What `KVSYNC_FAULTS` (`spec`; `None`: unset) asks for. Builds
    /// without the `faults` feature never inject any.
    fn read(spec: Option<&str>) -> Result<Faults, FaultsError> {
        match spec {
            Some(spec) if cfg!(feature = "faults") => Faults::parse(spec),
            Some(_) => {
                tracing::warn!("KVSYNC_FAULTS is set but this build has no fault injection (cargo feature `faults`); ignored");
                Ok(NONE)
            }
            None => Ok(NONE),
        }
    }

    pub fn parse(spec: &str) -> Result<Faults, FaultsError> {
        let mut f = Faults::default();
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| FaultsError::NotKeyValue(part.into()))?;
            if k == "hold_file" {
                f.rdma.hold_file = Some(v.into());
                continue;
            }
            let n: u64 = v.parse().map_err(|_| FaultsError::NotANumber {
                key: k.into(),
                value: v.into(),
            })?;
            match k {
                "corrupt_at" => f.corrupt_at = Some(n),
                "forge_at" => f.forge_at = Some(n),
                "stall_after" => f.stall_after = Some(n),
                "cut_after" => f.cut_after = Some(n),
                "cut_stream" => f.cut_stream = Some(n as u32),
                "handshake_ms" => f.handshake_ms = Some(n),
                "stream_corrupt_at" => f.stream_corrupt_at = Some(n),
                "stream_ack_on_tick" => f.stream_ack_on_tick = n != 0,
                "stream_ring_lie" => {
                    f.stream_ring_lie = match n {
                        1 => Some(HeaderLie::Magic),
                        2 => Some(HeaderLie::SequenceBack),
                        _ => return Err(FaultsError::Unknown(part.into())),
                    }
                }
                "rdma_corrupt_at" => f.emu.corrupt_at = Some(n),
                "rdma_cut_after" => f.emu.cut_after = Some(n),
                "rdma_drop_send" => f.emu.drop_send = Some(n as u32),
                "rdma_bad_rkey" => f.rdma.bad_rkey = n != 0,
                "rdma_no_file_mr" => f.rdma.no_file_mr = n != 0,
                "rdma_damage_piece" => f.rdma.damage_piece = Some(n as u32),
                "rdma_hold_after" => f.rdma.hold_after = Some(n),
                "rdma_write_after_verify" => f.rdma.write_after_verify = n != 0,
                _ => return Err(FaultsError::Unknown(k.into())),
            }
        }
        Ok(f)
    }

    pub fn any(&self) -> bool {
        *self != NONE
    }
}

#[cfg(test)]
mod tests {
    use super::{Faults, NONE};

    #[test]
    fn fault_hooks_exist_only_in_builds_with_the_faults_feature() {
        let f = Faults::read(Some("cut_after=5")).unwrap();
        assert_eq!(f.any(), cfg!(feature = "faults"), "{f:?}");
        assert!(!Faults::read(None).unwrap().any());
    }

    #[test]
    fn fault_specs_parse() {
        assert_eq!(Faults::parse("").unwrap(), NONE);
        let f = Faults::parse("corrupt_at=5, cut_after=10").unwrap();
        assert_eq!(
            (f.corrupt_at, f.cut_after, f.stall_after),
            (Some(5), Some(10), None)
        );
        let f = Faults::parse("rdma_corrupt_at=7,rdma_bad_rkey=1").unwrap();
        assert_eq!((f.emu.corrupt_at, f.rdma.bad_rkey), (Some(7), true));
        let f = Faults::parse("rdma_hold_after=8,hold_file=/tmp/h").unwrap();
        assert_eq!(
            (f.rdma.hold_after, f.rdma.hold_file),
            (Some(8), Some("/tmp/h".into()))
        );
        assert!(Faults::parse("explode=1").is_err());
        assert!(Faults::parse("cut_after=x").is_err());
    }
}
