// A behavioural model of the ECP5 DP16KD, for simulating memories as they are elaborated for
// an ECP5 (hbfp.hw.block_ram.dp16kd): only what that instance uses. Port A writes, port B
// reads, both DATA_WIDTH_A = DATA_WIDTH_B bits wide (1, 2, 4, 9, 18, or 36: the block's
// pseudo-dual-port mode, whose word is {DIB, DIA} written and {DOB, DOA} read). The word
// address is AD[13:k] (k = 0, 1, 2, 3, 4, 5 for those widths); at 18 and 36 bits the pins below
// enable the 9-bit bytes of a write (Lattice TN1264). A read registers its address in a cycle
// with CEB; REGMODE "OUTREG" passes the word through the output register (enable OCEB) a cycle
// later, "NOREG" gives it at once; the word holds while CEB is low. Chip selects must match
// CSDECODE ("0b000" and 0 in hbfp's instances); resets and GSR are not modelled (hbfp ties
// RST low); a write through port B or any other configuration stops the simulation. It
// stands in for the vendor's cell, which the open tools ship only as a black box.
module DP16KD #(
    parameter integer DATA_WIDTH_A = 18, parameter integer DATA_WIDTH_B = 18,
    parameter REGMODE_A = "NOREG", parameter REGMODE_B = "NOREG",
    parameter RESETMODE = "SYNC", parameter ASYNC_RESET_RELEASE = "SYNC",
    parameter CSDECODE_A = "0b000", parameter CSDECODE_B = "0b000",
    parameter WRITEMODE_A = "NORMAL", parameter WRITEMODE_B = "NORMAL",
    parameter GSR = "ENABLED"
) (
    input DIA0, DIA1, DIA2, DIA3, DIA4, DIA5, DIA6, DIA7, DIA8, DIA9, DIA10, DIA11, DIA12, DIA13, DIA14, DIA15, DIA16, DIA17,
    input ADA0, ADA1, ADA2, ADA3, ADA4, ADA5, ADA6, ADA7, ADA8, ADA9, ADA10, ADA11, ADA12, ADA13,
    input CEA, OCEA, CLKA, WEA, CSA0, CSA1, CSA2, RSTA,
    input DIB0, DIB1, DIB2, DIB3, DIB4, DIB5, DIB6, DIB7, DIB8, DIB9, DIB10, DIB11, DIB12, DIB13, DIB14, DIB15, DIB16, DIB17,
    input ADB0, ADB1, ADB2, ADB3, ADB4, ADB5, ADB6, ADB7, ADB8, ADB9, ADB10, ADB11, ADB12, ADB13,
    input CEB, OCEB, CLKB, WEB, CSB0, CSB1, CSB2, RSTB,
    output DOA0, DOA1, DOA2, DOA3, DOA4, DOA5, DOA6, DOA7, DOA8, DOA9, DOA10, DOA11, DOA12, DOA13, DOA14, DOA15, DOA16, DOA17,
    output DOB0, DOB1, DOB2, DOB3, DOB4, DOB5, DOB6, DOB7, DOB8, DOB9, DOB10, DOB11, DOB12, DOB13, DOB14, DOB15, DOB16, DOB17
);
    localparam integer W = DATA_WIDTH_A;
    localparam integer K = W == 36 ? 5 : W == 18 ? 4 : W == 9 ? 3 : W == 4 ? 2 : W == 2 ? 1 : 0;
    localparam integer DEPTH = 1 << (14 - K);
    localparam integer BYTES = W >= 18 ? W / 9 : 1;  // write enables
    localparam integer BW = W >= 18 ? 9 : W;  // bits per write enable

    wire [13:0] ada = {ADA13, ADA12, ADA11, ADA10, ADA9, ADA8, ADA7, ADA6, ADA5, ADA4, ADA3, ADA2, ADA1, ADA0};
    wire [13:0] adb = {ADB13, ADB12, ADB11, ADB10, ADB9, ADB8, ADB7, ADB6, ADB5, ADB4, ADB3, ADB2, ADB1, ADB0};
    wire [35:0] di = {DIB17, DIB16, DIB15, DIB14, DIB13, DIB12, DIB11, DIB10, DIB9, DIB8, DIB7, DIB6, DIB5, DIB4, DIB3, DIB2, DIB1, DIB0,
                      DIA17, DIA16, DIA15, DIA14, DIA13, DIA12, DIA11, DIA10, DIA9, DIA8, DIA7, DIA6, DIA5, DIA4, DIA3, DIA2, DIA1, DIA0};
    wire [3:0] be = W == 36 ? ada[3:0] : W == 18 ? {2'b00, ada[1:0]} : 4'b0001;
    wire cs_a = {CSA2, CSA1, CSA0} == 3'b000, cs_b = {CSB2, CSB1, CSB0} == 3'b000;

    reg [W-1:0] mem [0:DEPTH-1];
    reg [W-1:0] latch = 0, out = 0;
    integer i;

    initial begin
        if (DATA_WIDTH_B != W || (W != 1 && W != 2 && W != 4 && W != 9 && W != 18 && W != 36)
            || REGMODE_A != REGMODE_B || (REGMODE_B != "OUTREG" && REGMODE_B != "NOREG")
            || CSDECODE_A != "0b000" || CSDECODE_B != "0b000") begin
            $display("DP16KD model: a configuration hbfp does not instantiate (widths %0d/%0d, %s/%s)",
                     DATA_WIDTH_A, DATA_WIDTH_B, REGMODE_A, REGMODE_B);
            $finish;
        end
    end

    always @(posedge CLKA) if (CEA && WEA && cs_a) begin
        for (i = 0; i < BYTES; i = i + 1)
            if (be[i]) mem[ada[13:K]][i * BW +: BW] <= di[i * BW +: BW];
    end

    always @(posedge CLKB) begin
        if (CEB && WEB) begin
            $display("DP16KD model: a write through port B, which hbfp's instances never make");
            $finish;
        end
        if (CEB && cs_b) latch <= mem[adb[13:K]];
        if (OCEB) out <= latch;
    end

    wire [35:0] q = (REGMODE_B == "OUTREG") ? out : latch;
    wire [35:0] dq = W == 36 ? q : {q[17:0], 18'd0};  // {DOB, DOA}: narrower words leave on B
    assign {DOB17, DOB16, DOB15, DOB14, DOB13, DOB12, DOB11, DOB10, DOB9, DOB8, DOB7, DOB6, DOB5, DOB4, DOB3, DOB2, DOB1, DOB0,
            DOA17, DOA16, DOA15, DOA14, DOA13, DOA12, DOA11, DOA10, DOA9, DOA8, DOA7, DOA6, DOA5, DOA4, DOA3, DOA2, DOA1, DOA0} = dq;
endmodule
