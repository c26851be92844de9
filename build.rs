//! Generates the gRPC code from `proto/kvsync.proto` with a pure-Rust protobuf
//! compiler (no system `protoc` needed), plus the descriptor set served by
//! gRPC reflection.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/kvsync.proto");
    let fds = protox::compile(["proto/kvsync.proto"], ["proto"])?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("kvsync_descriptor.bin"),
        prost::Message::encode_to_vec(&fds),
    )?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
