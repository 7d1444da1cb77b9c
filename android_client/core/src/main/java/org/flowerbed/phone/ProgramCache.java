package org.flowerbed.phone;

import java.io.File;
import java.io.FileInputStream;
import java.io.IOException;
import java.io.InputStream;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;

/**
 * Training programs on the phone, one file per program named by its SHA-256.
 *
 * <p>{@link #fetch} returns the cached file when its hash is right, or downloads the program from
 * the gateway into {@code <sha256>.pte.part} (resuming a part left by an earlier, interrupted
 * download), checks its SHA-256 and only then renames it to {@code <sha256>.pte}. A file whose hash
 * is wrong is deleted, never used: a phone cannot run a program other than the one the task names.
 */
public final class ProgramCache {
  /** Fetches program bytes into a file, appending to what the file already holds. */
  public interface Downloader {
    void download(ProgramInfo program, File part) throws IOException;
  }

  private final File dir;
  private final Downloader downloader;

  /**
   * @param dir where programs are kept (created if missing)
   * @param downloader usually {@link GatewayClient#downloadProgram}
   */
  public ProgramCache(File dir, Downloader downloader) {
    this.dir = dir;
    this.downloader = downloader;
  }

  /**
   * The program's file, downloaded if it is not cached yet.
   *
   * @throws IllegalArgumentException starting "program:" if the downloaded bytes do not hash to the
   *     task's SHA-256 (the part is deleted, so the next task downloads afresh)
   * @throws IOException if the download fails or the directory cannot be written
   */
  public File fetch(ProgramInfo program) throws IOException {
    if (!dir.isDirectory() && !dir.mkdirs()) {
      throw new IOException("cannot create program cache " + dir);
    }
    File done = new File(dir, program.sha256() + ".pte");
    if (done.isFile()) {
      if (sha256(done).equals(program.sha256())) {
        return done;
      }
      delete(done); // damaged on disk: fetch it again
    }
    File part = new File(dir, program.sha256() + ".pte.part");
    if (part.length() > program.bytes()) {
      delete(part);
    }
    downloader.download(program, part);
    String got = sha256(part);
    if (!got.equals(program.sha256())) {
      delete(part);
      throw new IllegalArgumentException(
          "program: downloaded '"
              + program.name()
              + "' has SHA-256 "
              + got
              + ", the task names "
              + program.sha256());
    }
    if (!part.renameTo(done)) {
      throw new IOException("cannot rename " + part + " to " + done);
    }
    return done;
  }

  /** Hex SHA-256 of a file's bytes. */
  public static String sha256(File f) throws IOException {
    MessageDigest md;
    try {
      md = MessageDigest.getInstance("SHA-256");
    } catch (NoSuchAlgorithmException e) {
      throw new IllegalStateException("every Java platform has SHA-256", e);
    }
    InputStream in = new FileInputStream(f);
    try {
      byte[] buf = new byte[64 * 1024];
      int n;
      while ((n = in.read(buf)) >= 0) {
        md.update(buf, 0, n);
      }
    } finally {
      in.close();
    }
    StringBuilder hex = new StringBuilder();
    for (byte b : md.digest()) {
      hex.append(String.format("%02x", b & 0xff));
    }
    return hex.toString();
  }

  private static void delete(File f) throws IOException {
    if (f.exists() && !f.delete()) {
      throw new IOException("cannot delete " + f);
    }
  }
}
